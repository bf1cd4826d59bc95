"""Replay of a bag that rosbag2 could have recorded: the node's topics and its capsule services'
introspection events, taken over real DDS by subscribers as `ros2 bag record` takes them (the
ros2 CLI is not on PyPI here), written in rosbag2's layout with rosbags, no journal in it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rclpy")
pytest.importorskip("rosbags")

from rosbags.rosbag2 import Reader  # noqa: E402

from flashrt_ros.replay.bag import BagWriter  # noqa: E402
from flashrt_ros.replay.recording import read_recording  # noqa: E402
from flashrt_ros.replay.types import deserialize, stored_name, typestore  # noqa: E402

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


def _topics() -> dict:
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


def _record_a_policy_session(context, path: Path) -> None:
    """Steps, a snapshot, a rollback, a restore, a fork, a repeat, a refusal and a drop, against a
    node that introspects its services, recorded from outside the node."""
    from geometry_msgs.msg import PoseStamped
    from sensor_msgs.msg import JointState

    from ros_harness import Harness

    h = Harness(context, {"service_introspection": "contents"})
    recorder = TopicRecorder(context, path, _topics())
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


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    path = tmp_path_factory.mktemp("recording") / "robot"
    try:
        _record_a_policy_session(context, path)
    finally:
        context.try_shutdown()
    return path


def _replay(*args: str) -> subprocess.CompletedProcess:
    """flashrt-replay in a process of its own, at the vector kernels of this one, which the node
    recorded with (another test may have set ATEN_CPU_CAPABILITY for the processes it starts)."""
    import torch

    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if torch.backends.cpu.get_cpu_capability() in ("DEFAULT", "AVX2", "AVX512"):   # the x86 levels torch reads
        env["ATEN_CPU_CAPABILITY"] = torch.backends.cpu.get_cpu_capability().lower()
    return subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=Path(args[0]).parent, env=env)


def _copy_without(bag: Path, out: Path, topic: str, change=None, skip=None) -> None:
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
                    raw = store.serialize_cdr(msg, stored_name(connection.msgtype))
            writer.write_message(connection.topic, connection.msgtype, bytes(raw), stamp)
    writer.close()


def test_a_recording_of_the_nodes_topics_and_service_events_replays(recorded):
    assert (recorded / "metadata.yaml").is_file()
    with Reader(recorded) as reader:
        topics = {c.topic: c.msgtype for c in reader.connections}
    assert "/flashrt/journal" not in topics
    assert topics[f"{NODE}/snapshot/_service_event"] == "flashrt_ros/srv/Snapshot_Event"
    assert topics[f"{NODE}/joint_states"] == "sensor_msgs/msg/JointState"
    recording = read_recording(recorded)
    kinds = [e.kind for e in recording.journal.entries]
    # The repeat of request_id r1 changed nothing and is left out, as the node's journal leaves it.
    assert kinds.count("step") == 10 and kinds.count("snapshot") == 1 and recording.skipped_calls == 1
    assert kinds.count("restore") == 2 and kinds.count("drop") == 2 and "rollback" in kinds and "fork" in kinds
    done = _replay(str(recorded))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a rosbag2 recording of node /flashrt" in done.stdout, done.stdout
    # Recorded and replayed on this machine, in processes started alike: byte-identical.
    assert "exact:    identical: 17 operations, 0 tokens, 10 actions, 6 capsule calls, 1 refusals" in done.stdout, \
        done.stdout


def test_a_recording_without_the_session_record_exits_2_and_takes_it_from_another_bag(recorded, tmp_path):
    bare = tmp_path / "bare"
    _copy_without(recorded, bare, f"{NODE}/session")
    done = _replay(str(bare))
    assert done.returncode == 2 and "pass --session" in done.stderr, done.stderr
    done = _replay(str(bare), "--session", str(recorded))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_recording_whose_policy_acted_otherwise_fails_portable(recorded, tmp_path):
    actions = []

    def change(topic, msg):   # the sixth action, its first joint half a radian off
        if topic != f"{NODE}/action":
            return False
        actions.append(topic)
        if len(actions) == 6:
            msg.positions = msg.positions + np.eye(len(msg.positions))[0] * 0.5
        return len(actions) == 6

    changed = tmp_path / "changed"
    _copy_without(recorded, changed, "", change)
    done = _replay(str(changed), "--verdict", "portable")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "action: exact differs, portable differs" in done.stderr, done.stderr


def test_a_recording_at_the_metadata_level_is_refused_with_the_parameter_to_set(recorded, tmp_path):
    def strip(topic, msg):
        if topic.endswith("/_service_event"):
            msg.request, msg.response = [], []
            return True
        return False

    metadata = tmp_path / "metadata_only"
    _copy_without(recorded, metadata, "", strip)
    done = _replay(str(metadata))
    assert done.returncode == 2 and "service_introspection=contents" in done.stderr, done.stderr


def test_a_recording_that_began_after_an_observation_is_read_and_the_missed_step_is_named(recorded, tmp_path):
    seen = []

    def first_joint_state(topic):   # the recorder started after the node took the first one
        seen.append(topic)
        return topic == f"{NODE}/joint_states" and seen.count(topic) == 1

    late = tmp_path / "late"
    _copy_without(recorded, late, "", skip=first_joint_state)
    assert [e.kind for e in read_recording(late).journal.entries].count("step") == 9
    done = _replay(str(late))
    # A fresh engine has not taken the step the recording missed: the first call answered at
    # another position, and replay says so (exit 1), rather than refusing the whole bag.
    assert done.returncode == 1 and "position" in done.stderr, done.stdout + done.stderr
