"""The waypoint task in the simulation, interrupted and resumed, as a behaviour tree over ROS:

  hold the arm -> give the route -> route taken -> start the episode ->
      Interruptible(follow the route, urgent: go to the operator's point and hold)

The simulated arm (``flashrt_sim`` with task "route", lockstep) and the policy node
(``flashrt_node`` with policy.goal) run the loop between them: every joint state is one policy
step, every command one control period. The route goes to the policy once (~/route: a waypoint
per step on the first steps of the episode); the operator's request arrives as the blackboard's
``interrupt`` at a control period of the episode (``Operator``), and its point goes to the
policy as a goal, which the node serves in a fresh context (the episode-start capsule). The tree
judges visits from the end effector's pose, as ``sim.waypoints.Progress`` does in process. The
tree draws the episode's route from its seed (``sim.waypoints.Route``), as the simulation draws
the arm's start. The route's first pose is for the episode's first state, so between episodes
the loop is stopped first: the simulation holds (``~/hold``: done once the policy has answered
the last state out), then the route goes out, then the episode starts once the policy node has
taken the route (``reach.Taken``). Without the hold, a state of the episode before could take
the route's first pose, and without the wait the new episode's first state could reach the
policy before its route.

``resume="full"`` is the pattern (``bt.interruptible``): a snapshot when the request arrives, a
restore when it is served. ``resume="none"`` serves it the same way with no snapshot and no
restore (the ablation's row (d)).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import py_trees
from geometry_msgs.msg import PoseArray, PoseStamped
from py_trees.common import Access, Status
from py_trees.composites import Sequence as Seq
from sensor_msgs.msg import JointState
from std_srvs.srv import Trigger

from ..ros.sim_node import pose_at, seconds_of
from ..sim.arm import CONTROL_PERIOD_S
from ..sim.interruption import URGENT_MAX_PERIODS
from ..sim.waypoints import PERIODS_PER_WAYPOINT, VISIT_RADIUS_M, Route
from .interruptible import Interruptible
from .reach import EpisodeStarts, SimCall, Taken, Until

INTERRUPT_KEY = "interrupt"


class RouteWorld:
    """What the tree sees of the simulation: the episode's route, the arm's control periods, the
    end effector's positions since a behaviour last took them, each with its control period
    (from its stamp: the simulation's time starts at zero with each episode), and the waypoints
    visited (by whichever follower judged them)."""

    def __init__(self, node: Any, sim: str, server: str, frame_id: str = "base_link") -> None:
        self.node, self.frame_id = node, frame_id
        self.route: PoseArray | None = None
        self.periods = 0
        self.visited = 0
        self.latest = 0        # the control period of the newest position of this episode
        self.fresh = True      # no follower has run in this episode yet
        self._began = False    # this episode's first position (period 0) has come
        self._positions: list[tuple[int, np.ndarray]] = []
        self._lock = threading.Lock()   # the executor's thread appends, the tree's takes
        node.create_subscription(JointState, f"{server}/joint_states", self._on_state, 100)
        node.create_subscription(PoseStamped, f"{server}/ee_pose", self._on_pose, 100)
        self.route_out = node.create_publisher(PoseArray, f"{server}/route", 10)
        self.goal_out = node.create_publisher(PoseStamped, f"{server}/goal", 10)
        self.reset = node.create_client(Trigger, f"{sim}/reset")
        self.hold = node.create_client(Trigger, f"{sim}/hold")
        self.starts = EpisodeStarts(node, server)

    def new_episode(self, route: Route) -> None:
        """The episode of ``route``: nothing visited, nothing seen yet. Positions are taken from
        its first (period 0, after the reset) on: one writer's messages come in order, so every
        one before it is of the episode before."""
        self.route = PoseArray(poses=[pose_at(p) for p in route.waypoints])
        self.route.header.frame_id = self.frame_id
        self.visited, self.fresh = 0, True
        with self._lock:
            self._began, self._positions, self.latest = False, [], 0

    def _on_state(self, msg: JointState) -> None:
        self.periods += 1

    def _on_pose(self, msg: PoseStamped) -> None:
        p, period = msg.pose.position, round(seconds_of(msg.header.stamp) / CONTROL_PERIOD_S)
        with self._lock:
            if period == 0:
                self._began, self._positions = True, []
            if self._began:
                self._positions.append((period, np.array([p.x, p.y])))
                self.latest = period

    def take_positions(self) -> list[tuple[int, np.ndarray]]:
        """The end effector's positions (control period, (x, y)) of this episode published since
        the last take, oldest first."""
        with self._lock:
            taken, self._positions = self._positions, []
        return taken

    def waypoints(self) -> list[np.ndarray]:
        return [np.array([p.position.x, p.position.y]) for p in self.route.poses]


class FollowRoute(py_trees.behaviour.Behaviour):
    """Let the policy drive; each waypoint is visited when the end effector comes within the
    visit radius of it, in order. SUCCESS once all are; FAILURE when the waypoints left are not
    all visited within ``PERIODS_PER_WAYPOINT`` periods each from when this run began, or when
    the arm stops stepping. Visits are the world's: they carry over a halt (an interruption).

    The periods are the simulation's, read from the positions' stamps, not counted as messages
    come. The episode's first run judges the positions of periods 1 to its budget, as
    ``sim.interruption.run_route`` does in process, so its verdict does not depend on when the
    tree ticks; a later one (after an interruption) those after the newest position seen when it
    began."""

    def __init__(self, name: str, world: RouteWorld, stall_s: float = 10.0) -> None:
        super().__init__(name)
        self.world, self.stall_s = world, stall_s

    def initialise(self) -> None:
        world = self.world
        left = len(world.route.poses) - world.visited
        self._judged = 0 if world.fresh else world.latest   # what the arm did before is not judged
        world.fresh = False
        self._until = self._judged + PERIODS_PER_WAYPOINT * left
        self._seen, self._deadline = world.periods, time.monotonic() + self.stall_s

    def update(self) -> Status:
        world, waypoints = self.world, self.world.waypoints()
        for period, position in world.take_positions():
            if period > self._until:   # past the budget (its last period's position may have been lost)
                self._judged = self._until
                break
            if period <= self._judged or world.visited == len(waypoints):
                continue
            self._judged = period
            if np.linalg.norm(position - waypoints[world.visited]) < VISIT_RADIUS_M:
                world.visited += 1
        if world.visited == len(waypoints):
            self.feedback_message = f"all {len(waypoints)} waypoints visited"
            return Status.SUCCESS
        if self._judged >= self._until:
            self.feedback_message = f"{world.visited} of {len(waypoints)} waypoints visited in time"
            return Status.FAILURE
        periods = world.periods
        if periods != self._seen:   # stepping: the stall clock starts again
            self._seen, self._deadline = periods, time.monotonic() + self.stall_s
        elif time.monotonic() > self._deadline:
            self.feedback_message = f"the arm stopped stepping ({self.stall_s:g} s without a control period)"
            return Status.FAILURE
        return Status.RUNNING


class Urgent(py_trees.behaviour.Behaviour):
    """The operator's request: ``point`` to the policy as a goal, then SUCCESS once the end
    effector has been within the visit radius of it for ``hold`` periods since it first came
    there, or after ``URGENT_MAX_PERIODS`` periods (the tree gives up on it)."""

    def __init__(self, name: str, world: RouteWorld, point: Any, hold: int) -> None:
        super().__init__(name)
        self.world, self.point, self.hold = world, np.asarray(point, dtype=float), hold
        self.periods_taken = 0

    def initialise(self) -> None:
        goal = PoseStamped(pose=pose_at(self.point))
        goal.header.frame_id = self.world.frame_id
        self.world.take_positions()
        self.world.goal_out.publish(goal)
        self._start, self._arrived = self.world.periods, None

    def update(self) -> Status:
        for _, position in self.world.take_positions():
            if self._arrived is None and np.linalg.norm(position - self.point[:2]) < VISIT_RADIUS_M:
                self._arrived = self.world.periods
        self.periods_taken = self.world.periods - self._start
        held = self._arrived is not None and self.world.periods - self._arrived >= self.hold
        if held or self.periods_taken >= URGENT_MAX_PERIODS:
            self.feedback_message = "held there" if held else "given up on"
            return Status.SUCCESS
        return Status.RUNNING


class Operator:
    """Sets the blackboard's ``interrupt`` once the episode has run ``period`` control periods."""

    def __init__(self, world: RouteWorld, period: int) -> None:
        self.world, self.period = world, period
        self.start: int | None = None
        self.flag = py_trees.blackboard.Client(name="operator")
        self.flag.register_key(INTERRUPT_KEY, access=Access.WRITE)
        self.flag.set(INTERRUPT_KEY, False)
        self.fired = False

    def __call__(self) -> None:
        if self.start is None or self.fired:
            return
        if self.world.periods - self.start >= self.period:
            self.flag.set(INTERRUPT_KEY, True)
            self.fired = True


def give_route(world: RouteWorld) -> Until:
    """Publish the episode's route to the policy, once (it starts the policy's episode)."""
    def publish() -> None:
        world.starts.give()
        world.route_out.publish(world.route)

    return Until("give the route", lambda: world.route is not None and world.route_out.get_subscription_count() > 0
                 and world.starts.heard(), then=publish)


class StartEpisode(SimCall):
    """Reset the arm to the episode's start; the operator counts periods from there."""

    def __init__(self, world: RouteWorld, operator: Operator) -> None:
        super().__init__("start the episode", world.reset, Trigger.Request())
        self.world, self.operator = world, operator

    def update(self) -> Status:
        status = super().update()
        if status == Status.SUCCESS:
            self.operator.start = self.world.periods
        return status


def route_episode(node: Any, world: RouteWorld, operator: Operator, point: Any, hold: int,
                  resume: str, server: str = "/flashrt") -> tuple[py_trees.behaviour.Behaviour, FollowRoute, Urgent]:
    """One interrupted episode's tree, its route follower and its urgent request."""
    follow, urgent = FollowRoute("follow the route", world), Urgent("urgent: go and hold", world, point, hold)
    if resume == "full":
        served = Interruptible("route", node, follow, urgent, interrupt_key=INTERRUPT_KEY, server=server)
    elif resume == "none":
        served = Seq("route, urgent, route (no restore)", memory=True, children=[
            _UntilInterrupt(follow), urgent, FollowRoute("follow the route again", world)])
    else:
        raise ValueError(f"resume over ROS is 'full' or 'none', got {resume!r}")
    root = Seq("waypoint episode", memory=True, children=[
        SimCall("hold the arm", world.hold, Trigger.Request(), again=True), give_route(world),
        Taken("route taken", world.starts, world.route_out), StartEpisode(world, operator), served])
    return root, follow, urgent


class _UntilInterrupt(py_trees.decorators.Decorator):
    """Its child until the blackboard's ``interrupt`` turns true (then SUCCESS: the child is
    halted); the child's own end otherwise. The follower's visits carry over to the next one."""

    def __init__(self, child: FollowRoute) -> None:
        super().__init__(name=f"{child.name} until interrupted", child=child)
        self.flag = self.attach_blackboard_client(name="until interrupted")
        self.flag.register_key(INTERRUPT_KEY, access=Access.READ)

    def update(self) -> Status:
        if self.flag.exists(INTERRUPT_KEY) and self.flag.get(INTERRUPT_KEY):
            self.decorated.stop(Status.INVALID)
            return Status.SUCCESS
        return self.decorated.status

