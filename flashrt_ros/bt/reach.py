"""The reaching task in the simulation, as a behaviour tree over ROS (py_trees):

  hold the arm -> give the goal -> goal taken -> start the episode -> goal taken in -> snapshot ->
  jam the shoulder -> attempt, or else (free the joint, restore the snapshot, attempt again) ->
  drop the snapshot

The simulated arm (``flashrt_sim``, lockstep) and the policy node (``flashrt_node`` with
policy.goal) run the loop between them: every joint state the arm publishes is one policy step,
every JointTrajectory the policy answers with is one control period. The tree only gives the
goal, watches the arm and calls the capsule services. An attempt fails when the end effector
is not within ``SUCCESS_RADIUS_M`` of the goal ``ATTEMPT_STEPS`` control periods after it began.
The goal is for the episode's first state: the arm is held first (a pair that served an episode
before still runs its loop), and the episode starts once the node has taken the goal (``Taken``).

python -m flashrt_ros.bt.reach [--server /flashrt] [--sim /flashrt_sim] runs it once against a
live pair and prints each attempt's outcome.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any, Callable

import py_trees
from geometry_msgs.msg import PoseStamped
from py_trees.common import Status
from py_trees.composites import Selector, Sequence as Seq
from rclpy.duration import Duration
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from std_srvs.srv import SetBool, Trigger
from trajectory_msgs.msg import JointTrajectory

from ..msg import CapsuleEvent
from ..ros.policy_io import EPISODE_CAPSULE, REFUSED
from ..sim.task import ATTEMPT_STEPS, SUCCESS_RADIUS_M
from .behaviours import Drop, Restore, Snapshot

_LATCHED = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)


class EpisodeStarts:
    """What the policy node did with the goals and routes it was given: its restores of the
    episode-start capsule on ~/events, each a goal or route taken, or refused with the reason
    (``ros.policy_io``)."""

    def __init__(self, node: Any, server: str) -> None:
        self.taken = 0
        self.refusals: list[str] = []
        self._given = (0, 0)   # the counts when a goal or route last went out
        self._events = node.create_subscription(CapsuleEvent, f"{server}/events", self._on_event,
                                                QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))

    def _on_event(self, msg: CapsuleEvent) -> None:
        if msg.kind != CapsuleEvent.KIND_RESTORE or msg.capsule.name != EPISODE_CAPSULE:
            return
        if msg.success:
            self.taken += 1
        elif msg.message.startswith(REFUSED):   # not another client's ~/restore of the capsule
            self.refusals.append(msg.message)

    def heard(self) -> bool:
        """Whether the node's ~/events is matched: an event published before would be lost."""
        return self._events.get_publisher_count() > 0

    def give(self) -> None:
        """A goal or route goes out now."""
        self._given = (self.taken, len(self.refusals))

    def since_given(self) -> tuple[bool, str | None]:
        """(whether an episode started since the last ``give``, the reason of a refusal since)."""
        refused = self.refusals[self._given[1]:]
        return self.taken > self._given[0], refused[0] if refused else None


class World:
    """What the tree sees of the simulation: the episode's goal, the arm's periods and pose,
    and the policy's commands (counted). One per tree, shared by its behaviours."""

    def __init__(self, node: Any, sim: str, server: str) -> None:
        self.node = node
        self.starts = EpisodeStarts(node, server)
        self.goal: PoseStamped | None = None
        self.periods = 0      # joint states the arm has published this episode
        self.period_at: list[float] = []   # when each came (monotonic s): the loop's pace
        self.commands = 0     # JointTrajectory answers of the policy this episode
        self.pose: PoseStamped | None = None
        node.create_subscription(PoseStamped, f"{sim}/episode_goal", self._on_goal, _LATCHED)
        node.create_subscription(JointState, f"{server}/joint_states", self._on_state, 100)
        node.create_subscription(PoseStamped, f"{server}/ee_pose", self._on_pose, 100)
        node.create_subscription(JointTrajectory, f"{server}/joint_trajectory", self._on_command, 100)
        self.goal_out = node.create_publisher(PoseStamped, f"{server}/goal", 10)
        self.reset = node.create_client(Trigger, f"{sim}/reset")
        self.hold = node.create_client(Trigger, f"{sim}/hold")
        self.jam = node.create_client(SetBool, f"{sim}/jam")

    def _on_goal(self, msg: PoseStamped) -> None:
        self.goal = msg

    def _on_state(self, msg: JointState) -> None:
        self.periods += 1
        self.period_at.append(time.monotonic())

    def _on_pose(self, msg: PoseStamped) -> None:
        self.pose = msg

    def _on_command(self, msg: JointTrajectory) -> None:
        self.commands += 1

    def distance(self) -> float:
        if self.pose is None or self.goal is None:
            return math.inf
        p, g = self.pose.pose.position, self.goal.pose.position
        return math.hypot(p.x - g.x, p.y - g.y)


class SimCall(py_trees.behaviour.Behaviour):
    """A std_srvs call to the simulation, made once its service is there; SUCCESS on its
    answer's success, FAILURE on a refusal or after ``timeout_s``. With ``again``, a refusal is
    asked again, ``again_s`` after the refusal came, until ``timeout_s``: for a call that says "not
    yet" (the simulation's ~/hold)."""

    again_s = 0.01

    def __init__(self, name: str, client: Any, request: Any, timeout_s: float = 10.0, again: bool = False) -> None:
        super().__init__(name)
        self.client, self.request, self.timeout_s, self.again = client, request, timeout_s, again
        self._future = None
        self._deadline = 0.0

    def initialise(self) -> None:
        self._future, self._refusal, self._ask_at = None, "", 0.0
        self._deadline = time.monotonic() + self.timeout_s

    def update(self) -> Status:
        if self._future is None and self.client.service_is_ready() and time.monotonic() >= self._ask_at:
            self._future = self.client.call_async(self.request)
        if self._future is not None and self._future.done():
            answer = self._future.result()
            if answer.success:
                return Status.SUCCESS
            self._refusal = answer.message
            if not self.again:
                self.feedback_message = f"{self.client.srv_name}: {answer.message}"
                return Status.FAILURE
            self._future, self._ask_at = None, time.monotonic() + self.again_s
        if time.monotonic() > self._deadline:
            self.feedback_message = f"{self.client.srv_name}: " + (
                f"still {self._refusal!r} after {self.timeout_s:g} s" if self._refusal
                else f"no answer within {self.timeout_s:g} s")
            return Status.FAILURE
        return Status.RUNNING

    def terminate(self, new_status: Status) -> None:
        if new_status == Status.INVALID and self._future is not None and not self._future.done():
            self.client.remove_pending_request(self._future)   # halted: the answer is nobody's
        self._future = None


class Until(py_trees.behaviour.Behaviour):
    """SUCCESS once ``ready()`` holds (after ``then()``, if given); FAILURE after ``timeout_s``."""

    def __init__(self, name: str, ready: Callable[[], bool], then: Callable[[], None] | None = None,
                 timeout_s: float = 10.0) -> None:
        super().__init__(name)
        self.ready, self.then, self.timeout_s = ready, then, timeout_s

    def initialise(self) -> None:
        self._deadline = time.monotonic() + self.timeout_s

    def update(self) -> Status:
        if not self.ready():
            return Status.FAILURE if time.monotonic() > self._deadline else Status.RUNNING
        if self.then is not None:
            self.then()
        return Status.SUCCESS


def give_goal(world: World) -> Until:
    """Publish the episode's goal to the policy, once (it starts the policy's episode); the
    policy's commands are counted from here."""
    def publish() -> None:
        world.commands = 0
        world.starts.give()
        world.goal_out.publish(world.goal)

    return Until("give the goal", lambda: world.goal is not None and world.goal_out.get_subscription_count() > 0
                 and world.starts.heard(), then=publish)


class Taken(py_trees.behaviour.Behaviour):
    """SUCCESS once the policy node has taken what ``publisher`` gave it (a goal or a route): its
    episode start came on ~/events since ``starts.give``. FAILURE when the node refused it (the
    reason is the feedback) or after ``timeout_s``. Without this wait, the task and the arm's
    first state reach the node from two processes, in no set order: a state that came first
    would be answered without the task, and the arm would take that command before the
    episode's first step.

    Should no event come within ``ack_grace_s`` (the node's events writer not yet matched with
    this reader), every subscriber's acknowledgement of the task does too: the node takes a goal
    or route before a joint state found waiting with it, so a state sent after the
    acknowledgement comes after the task. Not sooner: a refusal is said by the event alone."""

    ack_grace_s = 1.0

    def __init__(self, name: str, starts: EpisodeStarts, publisher: Any, timeout_s: float = 10.0) -> None:
        super().__init__(name)
        self.starts, self.publisher, self.timeout_s = starts, publisher, timeout_s

    def initialise(self) -> None:
        self._began = time.monotonic()
        self._deadline = self._began + self.timeout_s

    def update(self) -> Status:
        started, refusal = self.starts.since_given()
        if refusal is not None:
            self.feedback_message = refusal
            return Status.FAILURE
        if started:
            return Status.SUCCESS
        if (time.monotonic() - self._began > self.ack_grace_s
                and self.publisher.wait_for_all_acked(Duration(seconds=0))):
            return Status.SUCCESS
        if time.monotonic() > self._deadline:
            self.feedback_message = f"not taken within {self.timeout_s:g} s"
            return Status.FAILURE
        return Status.RUNNING


def goal_taken_in(world: World) -> Until:
    """SUCCESS once the policy has answered its first observation of the episode (the goal step)."""
    return Until("goal taken in", lambda: world.commands >= 1)


class Attempt(py_trees.behaviour.Behaviour):
    """Let the policy drive for ``ATTEMPT_STEPS`` control periods; SUCCESS when the end effector
    is then within the radius of the goal, FAILURE otherwise (or when ``stall_s`` pass without a
    control period)."""

    def __init__(self, name: str, world: World, stall_s: float = 10.0) -> None:
        super().__init__(name)
        self.world, self.stall_s = world, stall_s
        self.outcomes: list[tuple[bool, float]] = []

    def initialise(self) -> None:
        self._until = self.world.periods + ATTEMPT_STEPS
        self._seen, self._deadline = self.world.periods, time.monotonic() + self.stall_s

    def update(self) -> Status:
        world = self.world
        if world.periods < self._until:
            if world.periods != self._seen:   # stepping: the stall clock starts again
                self._seen, self._deadline = world.periods, time.monotonic() + self.stall_s
            elif time.monotonic() > self._deadline:
                self.feedback_message = f"the arm stopped stepping ({self.stall_s:g} s without a control period)"
                return Status.FAILURE
            return Status.RUNNING
        reached = world.distance() < SUCCESS_RADIUS_M
        self.outcomes.append((reached, world.distance()))
        self.feedback_message = f"{'reached' if reached else 'missed'} the goal ({world.distance():.3f} m)"
        return Status.SUCCESS if reached else Status.FAILURE


def reach_with_retry(node: Any, server: str = "/flashrt", sim: str = "/flashrt_sim",
                     jam: bool = True) -> tuple[py_trees.behaviour.Behaviour, World, list[Attempt]]:
    """The tree, the world it watches, and its two attempts (their outcomes)."""
    world = World(node, sim, server)
    first, second = Attempt("attempt", world), Attempt("retry", world)
    root = Seq("reach, with a rollback on failure", memory=True, children=[
        SimCall("hold the arm", world.hold, Trigger.Request(), again=True),
        give_goal(world),
        Taken("goal taken", world.starts, world.goal_out),
        SimCall("start the episode", world.reset, Trigger.Request()),
        goal_taken_in(world),
        Snapshot("snapshot: goal taken in", node, "goal_taken_in", pin=True, server=server),
        *([SimCall("jam the shoulder", world.jam, SetBool.Request(data=True))] if jam else []),
        Selector("attempt, or roll back and retry", memory=True, children=[
            first,
            Seq("roll back and retry", memory=True, children=[
                SimCall("free the shoulder", world.jam, SetBool.Request(data=False)),
                Restore("restore: goal taken in", node, "goal_taken_in", server=server),
                second]),
        ]),
        Drop("drop the snapshot", node, "goal_taken_in", server=server),
    ])
    return root, world, [first, second]


def run(root: py_trees.behaviour.Behaviour, timeout_s: float = 60.0, period_s: float = 0.005) -> Status:
    tree = py_trees.trees.BehaviourTree(root)
    tree.setup(timeout=15.0)
    deadline = time.monotonic() + timeout_s
    while True:
        tree.tick()
        if root.status in (Status.SUCCESS, Status.FAILURE) or time.monotonic() > deadline:
            return root.status
        time.sleep(period_s)


def main(argv: list[str] | None = None) -> int:
    import rclpy

    from ..ros.spinning import spun

    parser = argparse.ArgumentParser(prog="python -m flashrt_ros.bt.reach", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="/flashrt")
    parser.add_argument("--sim", default="/flashrt_sim")
    args = parser.parse_args(argv)
    rclpy.init()
    try:
        node = rclpy.create_node("reach_tree")
        with spun(node):
            root, _, attempts = reach_with_retry(node, args.server, args.sim)
            status = run(root)
        for attempt in attempts:
            for reached, gap in attempt.outcomes:
                print(f"{attempt.name}: {'reached' if reached else 'missed'} the goal ({gap:.3f} m)")
        print(f"reach with retry: {status.name}")
        return 0 if status == Status.SUCCESS else 1
    finally:
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
