"""Stand-ins for robot skills in the example trees: they drive the node like a robot would.

``PolicySteps`` closes the loop over the node's policy topics: it publishes a
JointState (with the end-effector pose published beforehand), waits for the
action on ``~/action``, integrates it into the next joint positions, and so on.
A real skill would also check the world; here a scripted failure of the first
attempts stands in for a collision, so the rollback branch runs.

``PickBest`` scores explored branches. The score is a toy (the sum of the
branch's generated token ids); a robot would use a value head or a success check.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Any, Sequence

import py_trees
from geometry_msgs.msg import PoseStamped
from py_trees.common import Access, Status
from sensor_msgs.msg import JointState
from trajectory_msgs.msg import JointTrajectoryPoint


class PolicySteps(py_trees.behaviour.Behaviour):
    def __init__(self, name: str, node: Any, joints: Sequence[str], steps: int = 6, server: str = "/flashrt",
                 fail_attempts: int = 0, timeout_s: float = 10.0, gain: float = 0.01) -> None:
        super().__init__(name)
        self.node, self.joints, self.steps = node, list(joints), steps
        self.fail_attempts, self.timeout_s, self.gain = fail_attempts, timeout_s, gain
        server = server.rstrip("/")
        self._joint_pub = node.create_publisher(JointState, f"{server}/joint_states", 10)
        self._pose_pub = node.create_publisher(PoseStamped, f"{server}/ee_pose", 10)
        self._actions: deque[list[float]] = deque()
        node.create_subscription(JointTrajectoryPoint, f"{server}/action",
                                 lambda msg: self._actions.append(list(msg.positions)), 10)
        self.attempts = 0
        self._positions = [0.0] * len(self.joints)
        self._received = 0
        self._deadline = 0.0

    def setup(self, **kwargs: Any) -> None:
        """Wait until the node listens (messages sent before discovery are lost), then send the pose."""
        timeout = float(kwargs.get("timeout", 10.0))
        deadline = time.monotonic() + timeout
        while (self._joint_pub.get_subscription_count() == 0 or self._pose_pub.get_subscription_count() == 0
               or self.node.count_publishers(self._action_topic()) == 0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: the node's policy topics did not appear within {timeout:g} s")
            time.sleep(0.02)
        self._publish_pose()
        time.sleep(0.2)  # the pose must be there before the first joint state

    def _action_topic(self) -> str:
        return self._joint_pub.topic_name.rsplit("/", 1)[0] + "/action"

    def _publish_pose(self) -> None:
        pose = PoseStamped()
        pose.header.frame_id = "base_link"
        pose.pose.position.x, pose.pose.position.z = 0.4, 0.3
        pose.pose.orientation.w = 1.0
        self._pose_pub.publish(pose)

    def _publish_joints(self) -> None:
        msg = JointState(name=self.joints, position=self._positions, velocity=[0.0] * len(self.joints))
        msg.header.stamp = self.node.get_clock().now().to_msg()
        self._joint_pub.publish(msg)

    def initialise(self) -> None:
        self.attempts += 1
        self._actions.clear()
        self._positions = [0.0] * len(self.joints)
        self._received = 0
        self._deadline = time.monotonic() + self.timeout_s
        self._publish_joints()

    def update(self) -> Status:
        while self._actions:
            action = self._actions.popleft()
            self._received += 1
            self._positions = [p + self.gain * a for p, a in zip(self._positions, action)]
            if self._received < self.steps:
                self._publish_joints()
        if self._received >= self.steps:
            if self.attempts <= self.fail_attempts:
                self.feedback_message = f"attempt {self.attempts}: collision (scripted)"
                return Status.FAILURE
            self.feedback_message = f"attempt {self.attempts}: {self.steps} steps done"
            return Status.SUCCESS
        if time.monotonic() > self._deadline:
            self.feedback_message = f"{self._received}/{self.steps} actions within {self.timeout_s:g} s"
            return Status.FAILURE
        return Status.RUNNING


class PickBest(py_trees.behaviour.Behaviour):
    """Reads each branch's generation, writes the best end capsule to ``best_key`` and
    the others to ``loser_keys``."""

    def __init__(self, name: str, result_keys: Sequence[str], end_keys: Sequence[str], best_key: str,
                 loser_keys: Sequence[str]) -> None:
        super().__init__(name)
        if len(loser_keys) != len(end_keys) - 1:
            raise ValueError("one loser key per branch but the best")
        self.result_keys, self.end_keys, self.best_key, self.loser_keys = result_keys, end_keys, best_key, loser_keys
        self.bb = self.attach_blackboard_client(name=name)
        for key in (*result_keys, *end_keys):
            self.bb.register_key(key, access=Access.READ)
        for key in (best_key, *loser_keys):
            self.bb.register_key(key, access=Access.WRITE)

    def update(self) -> Status:
        scores = [sum(self.bb.get(k)["tokens"]) for k in self.result_keys]
        best = max(range(len(scores)), key=lambda i: (scores[i], -i))
        ends = [self.bb.get(k) for k in self.end_keys]
        self.bb.set(self.best_key, ends[best])
        for key, capsule in zip(self.loser_keys, [c for i, c in enumerate(ends) if i != best]):
            self.bb.set(key, capsule)
        self.feedback_message = f"branch {best} wins with score {scores[best]} of {scores}"
        return Status.SUCCESS
