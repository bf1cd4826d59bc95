"""Replay of a bag that rosbag2 could have recorded: the node's topics and its capsule services'
introspection events, taken over real DDS by subscribers as `ros2 bag record` takes them (the
ros2 CLI is not on PyPI here), written in rosbag2's layout with rosbags, no journal in it."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("rclpy")
pytest.importorskip("rosbags")

from rosbags.rosbag2 import Reader  # noqa: E402

from flashrt_ros.replay.recording import read_recording  # noqa: E402
from policy_recording import NODE, copy_without, recorded_session, replay, with_a_changed_action  # noqa: E402


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    return recorded_session(tmp_path_factory.mktemp("recording") / "robot")


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
    done = replay(str(recorded))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a rosbag2 recording of node /flashrt" in done.stdout, done.stdout
    # Recorded and replayed on this machine, in processes started alike: byte-identical.
    assert "exact:    identical: 17 operations, 0 tokens, 10 actions, 6 capsule calls, 1 refusals" in done.stdout, \
        done.stdout


def test_a_recording_without_the_session_record_exits_2_and_takes_it_from_another_bag(recorded, tmp_path):
    bare = tmp_path / "bare"
    copy_without(recorded, bare, f"{NODE}/session")
    done = replay(str(bare))
    assert done.returncode == 2 and "pass --session" in done.stderr, done.stderr
    done = replay(str(bare), "--session", str(recorded))
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_recording_whose_policy_acted_otherwise_fails_portable(recorded, tmp_path):
    changed = with_a_changed_action(recorded, tmp_path / "changed")
    done = replay(str(changed), "--verdict", "portable")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "action: exact differs, portable differs" in done.stderr, done.stderr


def test_a_recording_at_the_metadata_level_is_refused_with_the_parameter_to_set(recorded, tmp_path):
    def strip(topic, msg):
        if topic.endswith("/_service_event"):
            msg.request, msg.response = [], []
            return True
        return False

    metadata = tmp_path / "metadata_only"
    copy_without(recorded, metadata, "", strip)
    done = replay(str(metadata))
    assert done.returncode == 2 and "service_introspection=contents" in done.stderr, done.stderr


def test_a_recording_that_began_after_an_observation_is_read_and_the_missed_step_is_named(recorded, tmp_path):
    seen = []

    def first_joint_state(topic):   # the recorder started after the node took the first one
        seen.append(topic)
        return topic == f"{NODE}/joint_states" and seen.count(topic) == 1

    late = tmp_path / "late"
    copy_without(recorded, late, "", skip=first_joint_state)
    assert [e.kind for e in read_recording(late).journal.entries].count("step") == 9
    done = replay(str(late))
    # A fresh engine has not taken the step the recording missed: the first call answered at
    # another position, and replay says so (exit 1), rather than refusing the whole bag.
    assert done.returncode == 1 and "position" in done.stderr, done.stdout + done.stderr
