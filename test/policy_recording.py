"""A policy session of a node, recorded from outside it over real DDS, as `ros2 bag record`
takes it (the ros2 CLI is not on PyPI here): subscribers write each message's serialized bytes,
as received, into a bag in rosbag2's layout, with no journal in it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from rosbags.rosbag2 import Reader

from flashrt_ros.replay.bag import BagWriter
from flashrt_ros.replay.types import deserialize, typestore

NODE = "/flashrt"
SERVICES = ("snapshot", "restore", "fork", "rollback", "drop_capsule")


class TopicRecorder:
    """Subscribes to ``topics`` ({name: type}) and writes every message as it arrives (its serialized
    bytes, as received), its log time the middleware's receive stamp, into a rosbag2 MCAP bag (as ``ros2 bag record`` does)."""

    def __init__(self, context, path: Path, topics: dict) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        from flashrt_ros.ros.recorder import type_name

        self.bag = BagWriter(path, None)
        self.counts = {name: 0 for name in topics}
        self.node = rclpy.create_node(f"bag_recorder_{time.monotonic_ns() % 1_000_000}", context=context)
        latched = QoSProfile(depth=10, durability=DurabilityPolicy.TRANSIENT_LOCAL,
                             reliability=ReliabilityPolicy.RELIABLE)
        self.subscriptions = {}
        for name, msg_type in topics.items():
            def write(raw, info, name=name, msgtype=type_name(msg_type())):
                self.bag.write_message(name, msgtype, raw, info["received_timestamp"])
                self.counts[name] += 1
            self.subscriptions[name] = self.node.create_subscription(
                msg_type, name, write, latched if name.endswith("/session") else 100, raw=True)
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def wait(self, name: str, count: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.counts[name] < count:
            assert time.monotonic() < deadline, f"{name}: {self.counts[name]} of {count} messages recorded"
            time.sleep(0.005)

    def close(self) -> None:
        self.executor.shutdown(timeout_sec=5)
        self.thread.join(5)
        self.node.destroy_node()
        self.bag.close()


def topics() -> dict:
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import JointState
    from trajectory_msgs.msg import JointTrajectoryPoint

    from flashrt_ros import srv
    from flashrt_ros.msg import JournalSession

    topics = {f"{NODE}/session": JournalSession, f"{NODE}/joint_states": JointState, f"{NODE}/ee_pose": PoseStamped,
              f"{NODE}/action": JointTrajectoryPoint}
    for name, srv_type in zip(SERVICES, (srv.Snapshot, srv.Restore, srv.Fork, srv.Rollback, srv.DropCapsule)):
        topics[f"{NODE}/{name}/_service_event"] = srv_type.Event
    return topics


def recorded_session(path: Path) -> Path:
    """``record_policy_session`` into ``path``, in an rclpy context of its own."""
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        record_policy_session(context, path)
    finally:
        context.try_shutdown()
    return path


def record_policy_session(context, path: Path) -> None:
    """Steps, a snapshot, a rollback, a restore, a fork, a repeat, a refusal and a drop, against a
    node that introspects its services, recorded from outside the node."""
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import JointState

    from ros_harness import Harness

    h = Harness(context, {"service_introspection": "contents"})
    recorder = TopicRecorder(context, path, topics())
    try:
        joints, poses = h.policy_publishers()
        deadline = time.monotonic() + 10
        while any(s.get_publisher_count() == 0 for s in recorder.subscriptions.values()):
            missing = [name for name, s in recorder.subscriptions.items() if s.get_publisher_count() == 0]
            assert time.monotonic() < deadline, f"no publisher matched {missing}"
            time.sleep(0.01)
        names = [f"joint{i}" for i in range(1, 8)]
        steps = 0

        def step(k: int) -> None:
            nonlocal steps
            pose = PoseStamped()
            pose.header.stamp = h.client.get_clock().now().to_msg()
            pose.pose.position.x, pose.pose.orientation.w = 0.3 + 0.01 * k, 1.0
            poses.publish(pose)
            recorder.wait(f"{NODE}/ee_pose", k + 1)
            state = JointState(name=names, position=[0.1 * k + 0.01 * j for j in range(7)], velocity=[0.0] * 7)
            state.header.stamp = pose.header.stamp
            joints.publish(state)
            steps += 1
            recorder.wait(f"{NODE}/action", steps)

        k = 0
        for k in range(4):
            step(k)
        snap = h.call("snapshot", name="checkpoint", request_id="r1", pin=True)
        assert snap.success, snap.message
        assert h.call("snapshot", name="checkpoint", request_id="r1", pin=True).capsule_id == snap.capsule_id
        for k in range(4, 8):
            step(k)
        assert h.call("rollback", steps=2).success
        step(8)
        assert h.call("restore", capsule_id=snap.capsule_id).success
        fork = h.call("fork", source_id=snap.capsule_id, name="branch")
        assert fork.success, fork.message
        assert not h.call("restore", capsule_id="no-such-capsule").success   # a refusal, recorded and replayed
        step(9)
        assert h.call("drop_capsule", capsule_id=fork.capsule_id).success
        assert h.call("drop_capsule", capsule_id=snap.capsule_id).success
        recorder.wait(f"{NODE}/drop_capsule/_service_event", 4)   # request and response of both drops
    finally:
        recorder.close()
        h.close()


def replay(*args: str, command: tuple[str, ...] = (sys.executable, "-m", "flashrt_ros.replay.cli")) -> subprocess.CompletedProcess:
    """flashrt-replay in a process of its own, at the vector kernels of this one, which the node
    recorded with (another test may have set ATEN_CPU_CAPABILITY for the processes it starts)."""
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=180,
                          cwd=Path(args[0]).parent, env=same_kernels_env())


def same_kernels_env() -> dict[str, str]:
    """This process's environment, at its vector kernels for the processes it starts."""
    import torch

    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "AVX512"):   # the x86 levels torch reads
        env["ATEN_CPU_CAPABILITY"] = torch.backends.cpu.get_cpu_capability().lower()
    return env


def copy_without(bag: Path, out: Path, topic: str, change=None, skip=None) -> None:
    """A copy of ``bag`` without ``topic``, nor the messages ``skip(topic)`` is true for;
    ``change(topic, msg)`` may alter each message (and returns whether it did)."""
    store = typestore()
    writer = BagWriter(out, None)
    with Reader(bag) as reader:
        for connection, stamp, raw in reader.messages():
            if connection.topic == topic or (skip is not None and skip(connection.topic)):
                continue
            if change is not None:
                msg = deserialize(raw, connection.msgtype)
                if change(connection.topic, msg):
                    raw = store.serialize_cdr(msg, connection.msgtype)
            writer.write_message(connection.topic, connection.msgtype, bytes(raw), stamp)
    writer.close()


def with_a_changed_action(bag: Path, out: Path) -> Path:
    """A copy of ``bag`` whose sixth action has its first joint half a radian off: a policy
    that acted otherwise."""
    import numpy as np

    actions = []

    def change(topic, msg):
        if topic != f"{NODE}/action":
            return False
        actions.append(topic)
        if len(actions) == 6:
            msg.positions = msg.positions + np.eye(len(msg.positions))[0] * 0.5
        return len(actions) == 6

    copy_without(bag, out, "", change)
    return out
