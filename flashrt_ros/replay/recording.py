"""A journal rebuilt from a bag that rosbag2 recorded: the node's observation and action topics
and its capsule services' introspection events (at the contents level), as ``ros2 bag record``
writes them, with no journal of this package in it (no ROS imports: read with ``rosbags``).

The node's session record (flashrt_ros/msg/JournalSession, which it publishes on ``~/session``)
says what the bag cannot: the model and platform, the node's name and topics, its joint order
and its default tier. It comes from the bag itself, or from another bag that holds one.

Operations are put in the order the recorder received the node's outputs (an action, a
service's RESPONSE_SENT event), which is their commit order when one recorder took them all:
  - an observation is the last joint state before an action, paired with the pose before it,
    as the node pairs them; a joint state with no action after it (before the next one) was
    dropped by the node, or came while it was not active, and is not an operation; an action
    before any operation answers an observation the recording began after, and is left out;
  - a capsule call is its REQUEST_RECEIVED and RESPONSE_SENT events, matched by client and
    sequence number; a call refused as NOT_ACTIVE, and a Snapshot repeating an answered
    request_id, never reached the engine and are left out, as the node's own journal leaves them.
Such a bag records no state digests and no step positions, so its verdicts judge actions,
outcomes, error codes, capsule ids and the positions the services answered.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rosbags.rosbag2 import Reader

from ..errors import ErrorCode, InvalidArgument
from ..serving.journal import DROP, FORK, RESTORE, ROLLBACK, SNAPSHOT, STEP, Entry, Journal
from ..serving.record import SessionRecord
from ..serving.observation import observation_size, paired
from ..serving.operations import Operation, Snapshot, Step, requested
from ..serving.requests import SnapshotRequests
from .bag import SESSION_TYPE, messages, session_of_message
from .types import deserialize

# The outputs a journal rebuilt from a recording holds per kind (``journal.check_entries``).
RECORDED_OUTPUTS: dict[str, tuple[str, ...]] = {
    "*": ("error_code",), STEP: ("action",), SNAPSHOT: ("capsule_id", "position"),
    FORK: ("capsule_id", "position"), RESTORE: ("position",), ROLLBACK: ("position",), DROP: ("position",)}

_SERVICES = {"snapshot": SNAPSHOT, "fork": FORK, "restore": RESTORE, "rollback": ROLLBACK, "drop_capsule": DROP}
_REQUEST_RECEIVED, _RESPONSE_SENT = 1, 2   # service_msgs/msg/ServiceEventInfo event types


@dataclass
class Recording:
    """The journal of a recording, what was left out of it, and the messages each step was built
    from: ``inputs[seq]`` is (its ee_pose, its joint state), serialized as recorded."""
    journal: Journal
    inputs: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)
    dropped_observations: int = 0
    skipped_calls: int = 0
    notes: list[str] = field(default_factory=list)


def find_session(path: str | Path) -> SessionRecord | None:
    """The session record in a bag (the last JournalSession on any topic), or None."""
    found = None
    with Reader(Path(path)) as reader:
        connections = [c for c in reader.connections if c.msgtype == SESSION_TYPE]
        if not connections:   # (an empty list would read every connection)
            return None
        for connection, _, raw in reader.messages(connections=connections):
            found = session_of_message(deserialize(raw, SESSION_TYPE))
    return found


def read_recording(path: str | Path, session: SessionRecord | None = None) -> Recording:
    """The journal of a rosbag2 recording (see the module docstring). ``session``: the node's
    session record when the bag has none; InvalidArgument when neither has one, or when the bag
    holds nothing of the node that recorded it."""
    path = Path(path)
    session = find_session(path) or session
    if session is None:
        raise InvalidArgument(f"{path}: no {SESSION_TYPE} message, and none given: replay needs the node's session "
                              "record (the model, platform, node name and joint order); record the node's ~/session "
                              "topic with the others, or pass --session with a bag that holds it")
    if not session.node:
        raise InvalidArgument(f"{path}: the session record names no node (it was recorded in-process): only a "
                              "journal bag replays it")
    if session.obs_dim != observation_size(len(session.joint_names)):
        raise InvalidArgument(f"{path}: the node's observations hold {session.obs_dim} values, not the "
                              f"{observation_size(len(session.joint_names))} its joint states and pose give "
                              "(policy.goal): such a session replays from the node's journal bag only")
    topics = {"joint_states": session.joint_states_topic, "ee_pose": session.ee_pose_topic,
              "action": session.action_topic}
    services = {f"{session.node}/{name}/_service_event": kind for name, kind in _SERVICES.items()}
    builder = _Builder(session)
    with Reader(path) as reader:
        connections = [c for c in reader.connections if c.topic in topics.values() or c.topic in services]
        if not connections:
            raise InvalidArgument(f"{path}: none of the topics of node {session.node} ({', '.join(topics.values())}, "
                                  f"its service events): not a recording of that node")
        for connection, msg, raw in messages(path, reader, connections):
            topic = connection.topic
            if topic == topics["ee_pose"]:
                builder.pose = (msg, raw)
            elif topic == topics["joint_states"]:
                builder.joint_state(msg, raw)
            elif topic == topics["action"]:
                builder.action(msg)
            else:
                builder.service_event(services[topic], topic, msg)
    builder.finish()
    return builder.recording


class _Builder:
    def __init__(self, session: SessionRecord) -> None:
        self.recording = Recording(Journal(session=session))
        self._session = session
        self.pose: tuple[Any, bytes] | None = None   # the latest ee_pose, and its bytes
        self._observation: np.ndarray | None = None
        self._input: tuple[bytes, bytes] | None = None
        self._requests: dict[tuple, Any] = {}
        self._answered = SnapshotRequests()   # the snapshots made, by request_id

    def _add(self, op: Operation, outcome: dict[str, Any]) -> None:
        entries = self.recording.journal.entries
        entries.append(Entry(len(entries), op.KIND, op.journaled(), outcome))

    def joint_state(self, msg: Any, raw: bytes) -> None:
        if self._observation is not None:
            self.recording.dropped_observations += 1
        self._observation = None
        pose, pose_raw = self.pose or (None, b"")
        try:   # the node's pairing: a joint state it refused is no operation
            self._observation = paired(list(self._session.joint_names), msg, pose, self._session.max_pose_age)
        except InvalidArgument:
            return
        self._input = (pose_raw, raw)

    def action(self, msg: Any) -> None:
        if self._observation is None and not self.recording.journal.entries:
            self.recording.notes.append("the first action answers an observation from before the recording "
                                        "began, and is left out")
            return
        if self._observation is None:
            raise InvalidArgument("an action with no joint state before it that the node could "
                                  "have stepped: the bag misses observations, or its order is not the node's")
        action = np.asarray(msg.positions, dtype=np.float64).astype("<f4")
        self.recording.inputs[len(self.recording.journal.entries)] = self._input
        self._add(Step(self._observation), {"error_code": 0, "action": action.tobytes().hex()})
        self._observation = None

    def service_event(self, kind: str, topic: str, msg: Any) -> None:
        info = msg.info
        key = (topic, bytes(info.client_gid), int(info.sequence_number))
        if info.event_type == _REQUEST_RECEIVED:
            if not len(msg.request):
                raise InvalidArgument(f"{topic}: a request event without its request: the node introspected at "
                                      "the metadata level; replay needs service_introspection=contents")
            self._requests[key] = msg.request[0]
        elif info.event_type == _RESPONSE_SENT:
            request = self._requests.pop(key, None)
            if request is None:
                self.recording.skipped_calls += 1   # its request came before the recording began
                return
            if not len(msg.response):
                raise InvalidArgument(f"{topic}: a response event without its response: replay needs "
                                      "service_introspection=contents")
            self._call(kind, request, msg.response[0])

    def _call(self, kind: str, req: Any, resp: Any) -> None:
        code = int(resp.error_code)
        if code == ErrorCode.NOT_ACTIVE:
            self.recording.skipped_calls += 1
            return
        if getattr(req, "tier", "") == "fleet":
            raise InvalidArgument(f"a {kind} request of the fleet tier: a recording holds neither what was pulled "
                                  "nor what was published; replay the node's journal bag (journal_path) with "
                                  "--fleet-url")
        outcome: dict[str, Any] = {"error_code": code, "position": int(resp.position)}
        if code == 0 and kind in (SNAPSHOT, FORK):
            outcome["capsule_id"] = resp.capsule_id
        op = requested(kind, req, self._session.default_tier)
        if isinstance(op, Snapshot) and code == 0:
            # The node's repeat rule: a repeat was answered with the earlier capsule, nothing changed.
            # An id answered with other fields was another session's (the node reconfigured).
            try:
                repeat = self._answered.earlier(op.request_id, op.matched) is not None
            except InvalidArgument:
                repeat = False
            if repeat:
                self.recording.skipped_calls += 1
                return
            self._answered.remember(op.request_id, op.matched, resp.capsule_id)
        self._add(op, outcome)

    def finish(self) -> None:
        if self._observation is not None:
            self.recording.dropped_observations += 1
        if self._requests:
            self.recording.notes.append(f"{len(self._requests)} calls with no response recorded (the recording "
                                        "ended first) are left out")
        if not self.recording.journal.entries:
            raise InvalidArgument("the recording holds no step and no capsule call of the node")
