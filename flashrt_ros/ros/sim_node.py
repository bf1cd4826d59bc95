"""flashrt_sim: the simulated arm (``sim.arm``) as a ROS 2 node, headless.

Publishes, stamped with simulation time, once per control period:
  joint_states   sensor_msgs/JointState (joint1..joint3: position, velocity)
  ee_pose        geometry_msgs/PoseStamped of the end effector, in frame ``frame_id``
  /clock         rosgraph_msgs/Clock, so that nodes run with use_sim_time
  ~/episode_goal geometry_msgs/PoseStamped, transient local: the goal of the episode, for the
                 task giver (a behaviour tree) and the scripted expert; a policy never reads it
  ~/episode_route geometry_msgs/PoseArray, transient local, with ``task`` "route": the
                 episode's waypoints in order (``sim.waypoints``), for observers
Takes joint_trajectory (trajectory_msgs/JointTrajectory): what joint_trajectory_controller of
ros2_control takes, chosen over a forward controller's Float64MultiArray because it names its
joints and carries a stamp, so that a command can be checked against the arm and its age. The
first point's positions are the targets for the next control period. A command is refused, with
a logged reason, and the targets stay as they were, when its joint names are not the arm's, a
value is NaN or out of range, or its stamp is more than ``max_command_age`` s of simulation
time old (an unstamped command, stamp zero, means "now", as the message defines).

A command of more than ``max_command_bytes`` serialized bytes is refused before its points are
parsed (rclpy would build every point as a Python object, holding the executor meanwhile); its
stamp is not read, so in lockstep it answers nothing.

Services: ~/reset (std_srvs/Trigger) starts the episode of parameter ``seed`` (of the task
``task``: the reaching task's, or the waypoint task's route) at rest, and says how many states
were stepped unanswered and commands refused since the node started; ~/jam
(std_srvs/SetBool) holds joint1 where it is (the disturbance), or frees it; ~/hold
(std_srvs/Trigger) stops time until the next ~/reset: no state goes out meanwhile. In lockstep
a hold is done once the state out has been answered (its command's targets are taken, and time
does not go on) or stepped unanswered after the patience; until then ~/hold answers
success=false, "waiting for ...", and is asked again (the hold is in place from the first ask:
no state goes out after the one awaiting its answer). On its timer a hold is done at once, with
no answer to wait for. A task giver that starts the next episode in lockstep holds first: then
every state of the episode before has been answered, and the new task reaches a policy that has
nothing of the old episode left to answer. A reset ends a hold, and a hold asked after a reset
holds the new episode. Each service answers
success=false with the reason rather than raise.

Parameters (``PARAMS``: each number with its range, ``frame_id`` not empty, checked at start
and when set): ``seed``, ``frame_id``, ``max_command_age`` and ``max_command_bytes`` are read
when used and may be set at run time; the others shape the node's timers and are read once.

Time: with ``lockstep`` true, a control period is stepped once a command answering the latest
state has come (its stamp is that state's; a refused one steps with the targets held):
deterministic for a seed, and as fast as the policy answers. A state nobody answers within
``lockstep_patience`` s of wall clock is stepped with the targets held too (0: wait for ever).
In lockstep nothing is published before the first ~/reset. Otherwise a wall-clock timer steps
it, ``speed`` times faster than real time, from the start.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

from builtin_interfaces.msg import Time
from geometry_msgs.msg import Pose, PoseArray, PoseStamped
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.serialization import deserialize_message
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import JointState
from std_srvs.srv import SetBool, Trigger
from trajectory_msgs.msg import JointTrajectory

from ..errors import InvalidArgument
from ..sim.arm import JOINT_NAMES, Arm, ArmState
from ..sim.task import Episode
from ..sim.waypoints import Route
from .params import Param, check, declare_all
from .spinning import run_node

_LATCHED = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)


def stamp_of(seconds: float) -> Time:
    ns = round(seconds * 1e9)
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def seconds_of(stamp: Time) -> float:
    return stamp.sec + stamp.nanosec * 1e-9


class SimNode(Node):
    def __init__(self, node_name: str = "flashrt_sim", **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        declare_all(self, PARAMS)
        self.add_on_set_parameters_callback(lambda parameters: check(parameters, _reason))
        # rclpy applies a descriptor's range, not its constraint text: what no range can say.
        reason = _reason("frame_id", self.get_parameter("frame_id").value)
        if reason:
            raise InvalidArgument(f"frame_id: {reason}")
        self.arm = Arm()
        self.refused = self.unanswered = 0
        self._lock = threading.Lock()
        self._state: ArmState | None = None   # the latest state out; in lockstep, the one awaiting an answer
        self._holding = False   # ~/hold: time stands still until the next ~/reset
        self._published_at = 0.0   # wall clock (monotonic) of the last state published
        self._joints = self.create_publisher(JointState, "joint_states", 10)
        self._pose = self.create_publisher(PoseStamped, "ee_pose", 10)
        self._clock_out = self.create_publisher(Clock, "/clock", 10)
        self._goal = self.create_publisher(PoseStamped, "~/episode_goal", _LATCHED)
        self._route = self.create_publisher(PoseArray, "~/episode_route", _LATCHED)
        self._task = self.get_parameter("task").value
        self.create_subscription(JointTrajectory, "joint_trajectory", self._on_raw_command, 10, raw=True)
        self.create_service(Trigger, "~/reset", self._on_reset)
        self.create_service(SetBool, "~/jam", self._on_jam)
        self.create_service(Trigger, "~/hold", self._on_hold)
        speed = float(self.get_parameter("speed").value)
        self._lockstep = bool(self.get_parameter("lockstep").value)
        patience = float(self.get_parameter("lockstep_patience").value)
        if not self._lockstep:
            self.create_timer(self.arm.period / speed, self._tick)
        elif patience > 0:
            self.create_timer(patience / 4, lambda: self._unanswered(patience))
        self._reset(publish=not self._lockstep)   # the episode's goal, latched, either way

    # ---- episodes and disturbances ------------------------------------------------------------------
    def _reset(self, publish: bool = True) -> None:
        """The episode of parameter ``seed``, at rest: its goal published, and its first state
        unless ``publish`` is false (lockstep before the first ~/reset: no state goes out)."""
        seed, frame = int(self.get_parameter("seed").value), self.get_parameter("frame_id").value
        episode = Route.sample(seed) if self._task == "route" else Episode.sample(seed)
        with self._lock:
            state = self.arm.reset(episode.start)
            self._holding = False
            if self._task == "route":
                route = PoseArray(poses=[pose_at(p) for p in episode.waypoints])
                route.header.frame_id, route.header.stamp = frame, stamp_of(0.0)
                self._route.publish(route)
            else:
                goal = PoseStamped(pose=pose_at(episode.goal))
                goal.header.frame_id, goal.header.stamp = frame, stamp_of(0.0)
                self._goal.publish(goal)
            if publish:
                self._state = state
                self._publish(state)

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        seed = self.get_parameter("seed").value
        # What a driver of many episodes reads to know the loop kept up: a state stepped
        # unanswered is a control period the policy never saw.
        return _answer(response, self._reset, f"episode seed {seed} at rest; since the start, {self.unanswered} "
                                              f"states stepped unanswered and {self.refused} commands refused")

    def _on_hold(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            self._holding = True
            # Lockstep: the state out awaits its answer; the hold is done once it came.
            waiting = self._state if self._lockstep else None
            now = self.arm.state().time
        response.success = waiting is None
        response.message = (f"held at t={now:.3f} s until the next ~/reset" if waiting is None else
                            f"waiting for the answer to the state at t={waiting.time:.3f} s; ask again")
        return response

    def _on_jam(self, request: SetBool.Request, response: SetBool.Response) -> SetBool.Response:
        def jam() -> None:
            with self._lock:
                if request.data:
                    self.arm.block(0)
                else:
                    self.arm.unblock()
        return _answer(response, jam, "joint1 jammed" if request.data else "joint1 free")

    # ---- commands -----------------------------------------------------------------------------------
    def _on_raw_command(self, raw: bytes) -> None:
        limit = self.get_parameter("max_command_bytes").value
        if len(raw) > limit:
            self.refused += 1
            self.get_logger().warning(f"command refused: {len(raw)} serialized bytes, more than max_command_bytes "
                                      f"{limit}", throttle_duration_sec=2.0)
            return
        self._on_command(deserialize_message(raw, JointTrajectory))

    def _on_command(self, msg: JointTrajectory) -> None:
        try:
            target = self._check(msg)
        except InvalidArgument as exc:
            self.refused += 1
            self.get_logger().warning(f"command refused: {exc}", throttle_duration_sec=2.0)
            target = None
        with self._lock:
            if target is not None:
                self.arm.command(target)
            answers = self._state is not None and msg.header.stamp == stamp_of(self._state.time)
            if self._lockstep and answers:   # refused or not, the policy answered: time goes on
                self._advance()   # (or, held, stands still)

    def _unanswered(self, patience: float) -> None:
        """Lockstep: a state the policy has not answered within ``patience`` s of wall clock (an
        observation it dropped) is stepped with the targets held, so the episode goes on."""
        with self._lock:
            if self._state is None or time.monotonic() - self._published_at < patience:
                return
            self.unanswered += 1
            then = "held, standing still" if self._holding else "stepping with the targets held"
            self.get_logger().warning(f"no command answered the state at t={self._state.time:.2f} s within "
                                      f"{patience:g} s: {then}", throttle_duration_sec=2.0)
            self._advance()   # (or, held, standing still)

    def _check(self, msg: JointTrajectory) -> Any:
        if not msg.points:
            raise InvalidArgument("a trajectory without points")
        target = self.arm.check_command(msg.joint_names, msg.points[0].positions)
        age_limit = float(self.get_parameter("max_command_age").value)
        stamped = msg.header.stamp.sec or msg.header.stamp.nanosec
        with self._lock:
            now = self.arm.state().time
        if stamped and seconds_of(msg.header.stamp) > now + 1e-9:
            raise InvalidArgument(f"stamped {seconds_of(msg.header.stamp):.3f} s, after the simulation's "
                                  f"{now:.3f} s (a command from before a reset?)")
        if age_limit > 0 and stamped and now - seconds_of(msg.header.stamp) > age_limit:
            raise InvalidArgument(f"stamped {now - seconds_of(msg.header.stamp):.3f} s of simulation time ago "
                                  f"(max_command_age {age_limit:g} s)")
        return target

    # ---- time ---------------------------------------------------------------------------------------
    def _tick(self) -> None:
        with self._lock:
            self._advance()

    def _advance(self) -> None:
        """One control period, and the state it ends in published (the caller holds the lock);
        held, nothing: no state awaits an answer any more."""
        if self._holding:
            self._state = None
            return
        self._state = self.arm.advance()
        self._publish(self._state)

    def _publish(self, state: ArmState) -> None:
        stamp = stamp_of(state.time)
        self._clock_out.publish(Clock(clock=stamp))
        joints = JointState(name=list(JOINT_NAMES), position=state.position.tolist(), velocity=state.velocity.tolist())
        joints.header.stamp = stamp
        pose = PoseStamped()
        pose.header.stamp, pose.header.frame_id = stamp, self.get_parameter("frame_id").value
        pose.pose.position.x, pose.pose.position.y, pose.pose.position.z = (float(v) for v in state.ee_position)
        w, x, y, z = (float(v) for v in state.ee_quaternion)
        pose.pose.orientation.w, pose.pose.orientation.x, pose.pose.orientation.y, pose.pose.orientation.z = w, x, y, z
        # The pose first: the policy node pairs a joint state with the latest pose it took.
        self._pose.publish(pose)
        self._joints.publish(joints)
        self._published_at = time.monotonic()


PARAMS = (
    Param("seed", 0, "episode that ~/reset starts (its start pose and goal)", read_only=False, lo=0, hi=2**31 - 1),
    Param("task", "reach", "the episodes ~/reset starts: the reaching task's (a goal) or the waypoint task's "
          "(a route)", choices=("reach", "route")),
    Param("speed", 1.0, "multiple of real time the timer steps at (lockstep false)", lo=1e-3, hi=1e3),
    Param("lockstep", False, "step a control period once a command answers the latest state"),
    Param("frame_id", "base_link", "frame of ~/ee_pose and ~/episode_goal (not empty)", read_only=False),
    Param("max_command_age", 0.5, "seconds of simulation time a stamped command may be old; 0 = no check",
          read_only=False, lo=0.0, hi=3600.0),
    Param("lockstep_patience", 1.0, "lockstep: wall-clock seconds before an unanswered state is stepped "
          "with the targets held; 0 = wait for ever", lo=0.0, hi=3600.0),
    Param("max_command_bytes", 65536, "largest joint_trajectory taken, serialized; larger ones are refused "
          "before their points are parsed", read_only=False, lo=256, hi=1 << 24),
)


def _reason(name: str, value: Any) -> str:
    if name == "task" and value not in ("reach", "route"):
        return f"{value!r} is not reach or route"
    return "must not be empty" if name == "frame_id" and not value else ""


def pose_at(point: Any) -> Pose:
    """A pose at ``point`` (x, y, z in metres), unrotated: how a goal or a waypoint goes out."""
    pose = Pose()
    pose.position.x, pose.position.y, pose.position.z = (float(v) for v in point)
    pose.orientation.w = 1.0
    return pose


def _answer(response: Any, act: Callable[[], None], done: str) -> Any:
    """``response`` with success and ``done``, or success=false and the reason ``act`` failed:
    a service of the simulator answers every request and never raises into the executor."""
    try:
        act()
        response.success, response.message = True, done
    except Exception as exc:   # a request must not end in a traceback and an unanswered client
        response.success, response.message = False, f"{type(exc).__name__}: {exc}"
    return response


def main(argv: list[str] | None = None) -> int:
    return run_node("flashrt_sim", SimNode, SingleThreadedExecutor, args=argv)


if __name__ == "__main__":
    sys.exit(main())
