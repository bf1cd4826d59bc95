"""The policy's topics: observations in, actions out, one committed step per joint state.

In:  ~/ee_pose (PoseStamped) and ~/joint_states (JointState), with the QoS reliability of
     ``policy.input_reliability``: best_effort also takes sensor-data publishers, reliable
     only reliable ones; with ``policy.goal``, ~/goal (PoseStamped, reliable), taken into the
     next observation only, and ~/route (PoseArray, reliable): its poses taken into the next
     observations, one per step, in order (a task given once, as a sequence of targets). Poses,
     goals and routes in another frame than ``policy.frame_id`` are refused.
Out: ~/action (JointTrajectoryPoint, the action vector as the engine gave it) and, when the
     action is a position per joint, ~/joint_trajectory (JointTrajectory): the command a
     ros2_control joint_trajectory_controller (or the simulated arm) takes, with the joint
     names; with ``policy.command_stamp`` "observation" its stamp is the answered joint
     state's (a simulator matches the two, and can check the command's age), with "zero" it
     is unstamped (start now, as joint_trajectory_controller reads a zero stamp).

With ``policy.goal`` each goal or route starts an episode: the state is restored from the capsule made
at configure, before anything was committed ("episode-start", pinned), so that a robot can run
for hours while every episode's context stays within max_seq_len. The restore goes out on
~/events like any other, kind restore with the episode-start capsule; a goal or route refused
(another frame, a position not finite, no poses, the node not serving, the capsule dropped) goes
out as a failed one, with its error code and reason. A task giver that waits for it knows
whether the goal was taken, and that the next joint state is the first to get it. When the state is full
anyway, the step is refused with CONTEXT_FULL, said once per filling on ~/events and at ERROR
on /diagnostics, until a restore, rollback or goal frees it.
"""
from __future__ import annotations

import math
from collections import deque
import traceback
from typing import Any, Callable

from geometry_msgs.msg import PoseArray, PoseStamped
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from ..capsule import CapsuleInfo
from ..errors import ContextFull, ErrorCode, FlashRTError, InvalidArgument
from ..serving import Session
from ..serving.observation import paired, with_goal
from .convert import outcome
from .side_node import SideNode

EPISODE_CAPSULE = "episode-start"
REFUSED = ("~/goal refused", "~/route refused")   # how the events of refused goals and routes begin


class PolicyIO:
    """Made at configure with the node's policy parameters; ``close`` destroys what it made.

    The topics live on a side node of their own (``side_node``); their names are resolved as
    the lifecycle node's (``~`` is its)."""

    def __init__(self, node: Any, vals: dict[str, Any], record: Callable[[str, Any], None],
                 on_full: Callable[[str], None], on_step: Callable[[], None], on_reject: Callable[[], None],
                 on_episode: Callable[[CapsuleInfo | None, int, str], None]) -> None:
        """``on_episode(info, error_code, message)``: an episode-start restore, done (code 0) or refused."""
        self._node, self._record, self._on_full, self._on_episode = node, record, on_full, on_episode
        self._on_step, self._on_reject = on_step, on_reject
        self.joint_names = list(vals["policy.joint_names"])
        self.max_pose_age = float(vals["policy.max_pose_age"])
        self._frame = vals["policy.frame_id"]
        self._goal_mode = bool(vals["policy.goal"])
        self._latest_pose: PoseStamped | None = None
        self._goals: deque[tuple[float, float, float]] = deque()   # one per step, the first next
        self._episode: CapsuleInfo | None = None   # the capsule each goal restores (start_episodes)
        self._stamp_commands = vals["policy.command_stamp"] == "observation"
        self._full = False
        reliability = (ReliabilityPolicy.BEST_EFFORT if vals["policy.input_reliability"] == "best_effort"
                       else ReliabilityPolicy.RELIABLE)
        qos = QoSProfile(depth=10, reliability=reliability)
        self._side = SideNode(node, "policy",
                              lambda trace: node.get_logger().error(f"policy callback failed:\n{trace}"))
        self._io = self._side.node
        topic = node.resolve_topic_name
        # An executor that finds several waiting takes them in the order they were made: the pose
        # first, as a joint state is paired with the latest pose taken; a goal or route before the
        # joint state, as it is given for the states that follow it.
        self._io.create_subscription(PoseStamped, topic("~/ee_pose"), self._on_pose, qos)
        if self._goal_mode:
            self._io.create_subscription(PoseStamped, topic("~/goal"), self._on_goal, 10)
            self._io.create_subscription(PoseArray, topic("~/route"), self._on_route, 10)
        self._io.create_subscription(JointState, topic("~/joint_states"), self._on_joint_state, qos)
        self._action = self._io.create_publisher(JointTrajectoryPoint, topic("~/action"), 10)
        self._trajectory = (self._io.create_publisher(JointTrajectory, topic("~/joint_trajectory"), 10)
                            if vals["policy.action_dim"] == len(self.joint_names) else None)
        self._side.start()

    def close(self) -> None:
        """Stop taking observations; a step in flight finishes first (it holds the engine lock)."""
        self._action = self._trajectory = None
        self._side.stop(5.0)

    def start_episodes(self, session: Session) -> None:
        """With goals: the capsule each goal restores (the state as configure left it)."""
        if self._goal_mode:
            self._episode = session.snapshot(name=EPISODE_CAPSULE, pin=True).info

    # ---- inputs -------------------------------------------------------------------------------------
    def _in_frame(self, msg: PoseStamped, topic: str) -> bool:
        if self._frame and msg.header.frame_id != self._frame:
            self._reject(f"{topic} is in frame {msg.header.frame_id!r}, the policy's is {self._frame!r} "
                         "(policy.frame_id)")
            return False
        return True

    def _on_pose(self, msg: PoseStamped) -> None:
        self._record("~/ee_pose", msg)
        if self._in_frame(msg, "~/ee_pose"):
            self._latest_pose = msg

    def _on_goal(self, msg: PoseStamped) -> None:
        self._record("~/goal", msg)
        self._start_episode(msg, "~/goal", [msg.pose])

    def _on_route(self, msg: PoseArray) -> None:
        self._record("~/route", msg)
        self._start_episode(msg, "~/route", list(msg.poses))

    def _start_episode(self, msg: Any, topic: str, poses: list) -> None:
        """Restore the episode-start capsule, then take ``poses`` into the next steps, one each."""
        node = self._node
        session = node.session
        if not node.serving or session is None:
            self._refuse(topic, ErrorCode.NOT_ACTIVE, "the node is not serving")
            return
        if self._frame and msg.header.frame_id != self._frame:
            self._refuse(topic, ErrorCode.INVALID_ARGUMENT, f"it is in frame {msg.header.frame_id!r}, the "
                         f"policy's is {self._frame!r} (policy.frame_id)")
            return
        if not poses:
            self._refuse(topic, ErrorCode.INVALID_ARGUMENT, "it has no poses")
            return
        goals = [(float(p.position.x), float(p.position.y), float(p.position.z)) for p in poses]
        if not all(math.isfinite(v) for goal in goals for v in goal):
            self._refuse(topic, ErrorCode.INVALID_ARGUMENT, "a position is not finite")
            return
        try:
            info = session.restore(self._episode.id)
        except FlashRTError as exc:   # the capsule dropped by a client, say: the live state is untouched
            self._refuse(topic, *outcome(exc))
            return
        except Exception as exc:  # a goal must never take the node down
            node.get_logger().error(f"{topic} failed: {outcome(exc)[1]}\n{traceback.format_exc()}")
            self._refuse(topic, *outcome(exc))
            return
        self._goals, self._full = deque(goals), False
        self._on_episode(info, 0, f"{topic} started an episode from capsule {EPISODE_CAPSULE}: "
                                  f"{len(goals)} pose(s) for the next steps")

    def _on_joint_state(self, msg: JointState) -> None:
        self._record("~/joint_states", msg)
        node = self._node
        session = node.session
        if not node.serving or session is None or not session.engine.config.policy:
            return
        try:
            obs = paired(self.joint_names, msg, self._latest_pose, self.max_pose_age)
            if self._goal_mode:
                obs = with_goal(obs, self._goals[0] if self._goals else None)
            with session.engine.lock:
                if node.session is not session:   # freed (deactivated) while this waited for the lock
                    return
                # Checked under the engine lock, which a goal holds for each token it commits:
                # a step now would land between two of its tokens, inside the text it returns.
                if node.generating():
                    self._reject("a generate goal is running; a step would interleave with its tokens")
                    return
                action = session.step(obs)
        except ContextFull as exc:
            if not self._full:
                self._full = True
                self._on_full(str(exc))
            self._reject(str(exc))
            return
        except InvalidArgument as exc:
            self._reject(str(exc))
            return
        except Exception as exc:  # a bad observation must never take the node down
            node.get_logger().error(f"policy step failed: {outcome(exc)[1]}\n{traceback.format_exc()}")
            return
        if self._goals:
            self._goals.popleft()
        self._full = False
        self._on_step()
        self._publish(action.double().tolist(), msg)

    def _publish(self, positions: list[float], answered: JointState) -> None:
        action, trajectory_out = self._action, self._trajectory   # close() may run meanwhile
        try:
            if action is not None:
                command = JointTrajectoryPoint(positions=positions)
                action.publish(command)
                self._record("~/action", command)
            if trajectory_out is not None:
                trajectory = JointTrajectory(joint_names=self.joint_names,
                                             points=[JointTrajectoryPoint(positions=positions)])
                if self._stamp_commands:
                    trajectory.header.stamp = answered.header.stamp
                trajectory_out.publish(trajectory)
        except Exception as exc:   # destroyed by a cleanup that ran meanwhile: the step is committed
            if self._node.context.ok():
                self._node.get_logger().error(f"action not published: {outcome(exc)[1]}")

    def _refuse(self, topic: str, code: int, why: str) -> None:
        """A goal or route not taken: the episode goes on as it was, and ~/events says why."""
        self._reject(f"{topic} refused: {why}")
        self._on_episode(self._episode, int(code), f"{topic} refused: {why}")

    def _reject(self, why: str) -> None:
        self._on_reject()
        self._node.get_logger().warning(f"observation dropped: {why}", throttle_duration_sec=5.0)
