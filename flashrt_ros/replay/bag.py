"""Journal <-> rosbag2 MCAP bag, with real ROS types, written and read with ``rosbags`` (no ROS).

Topics of a journal bag:
  /flashrt/journal/session  flashrt_ros/msg/JournalSession: the engine and platform (one message)
  /flashrt/journal          flashrt_ros/msg/JournalEntry: one per committed operation, in commit order
The node adds the topics it served, each with its own type (``write_message``): observations,
actions, Generate goals and results, service events and capsule events (``ros.recorder``).
Replay reads the two journal topics; every other tool sees every topic with its type.
"""
from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
from rosbags.highlevel import AnyReader
from rosbags.interfaces import MessageDefinition, MessageDefinitionFormat
from rosbags.rosbag2 import Reader, StoragePlugin, Writer

from ..errors import InvalidArgument
from ..serving.record import SessionRecord
from ..serving.journal import (DECODE, DROP, FORK, KINDS, PREFILL, PULL, RESTORE, ROLLBACK, SNAPSHOT, SPILL, STEP, Entry,
                               Journal)
from .types import deserialize, schema_text, type_hash, typestore

SESSION_TOPIC = "/flashrt/journal/session"
ENTRY_TOPIC = "/flashrt/journal"
SESSION_TYPE = "flashrt_ros/msg/JournalSession"
ENTRY_TYPE = "flashrt_ros/msg/JournalEntry"

# Request fields of each kind, as the session layer records them (DECODE's are optional).
_REQUEST = {PREFILL: ("token_ids", "prompt"), DECODE: (), STEP: ("observation",),
            SNAPSHOT: ("name", "tier", "pin", "request_id", "requested_tier", "lease_s"),
            FORK: ("source_id", "name", "tier", "lease_s"), RESTORE: ("capsule_id", "verify"),
            ROLLBACK: ("steps", "to_position"), DROP: ("capsule_id", "request_id"), SPILL: ("spill",),
            PULL: ("capsule_id", "name", "tier")}
_REQUEST_FIELDS = {"token_ids", "prompt", "temperature", "top_k", "top_p", "seed", "observation", "name", "tier",
                   "requested_tier", "pin", "request_id", "lease_s", "source_id", "capsule_id", "verify", "steps",
                   "to_position", "spill"}
_OUTCOME_FIELDS = {"error_code", "position", "token", "margin", "action", "capsule_id", "state_digest"}
_SESSION_SCALARS = ("version", "model_path", "seed", "dtype", "max_seq_len", "obs_dim", "action_dim", "rollback_depth",
                    "spill", "disk_tier", "model_fingerprint", "layout_fingerprint", "device", "torch",
                    "torch_threads", "aten_cpu_capability", "cpu", "cuda_graphs", "fixed_shapes", "cpu_kernels",
                    "capsule_dir", "node", "default_tier", "joint_states_topic", "ee_pose_topic", "action_topic",
                    "max_pose_age")


def _stamp(ns: int) -> Any:
    Time = typestore().types["builtin_interfaces/msg/Time"]
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


def _header(ns: int) -> Any:
    return typestore().types["std_msgs/msg/Header"](stamp=_stamp(ns), frame_id="")


def entry_message(entry: Entry, stamp_ns: int) -> Any:
    """The JournalEntry of ``entry``; ValueError for a field the type has no room for."""
    req, out = entry.request, entry.outcome
    unknown = (set(req) - _REQUEST_FIELDS) | (set(out) - _OUTCOME_FIELDS)
    if unknown:
        raise ValueError(f"journal entry {entry.seq} ({entry.kind}) has fields JournalEntry has not: {sorted(unknown)}")
    fields = {
        "header": _header(stamp_ns), "seq": entry.seq, "kind": entry.kind,
        "token_ids": np.asarray(req.get("token_ids", []), dtype=np.int64), "prompt": req.get("prompt", ""),
        "temperature": float(req.get("temperature", 0.0)), "top_k": int(req.get("top_k", 0)),
        "top_p": float(req.get("top_p", 1.0)), "has_seed": "seed" in req,
        "seed": int(req.get("seed") or 0), "observation": np.asarray(req.get("observation", []), dtype=np.float32),
        "name": req.get("name", ""), "tier": req.get("tier", ""), "requested_tier": req.get("requested_tier", ""),
        "pin": bool(req.get("pin", False)), "request_id": req.get("request_id", ""),
        "lease_s": float(req.get("lease_s", 0.0)), "source_id": req.get("source_id", ""),
        "capsule_id": req.get("capsule_id", ""), "verify": bool(req.get("verify", False)),
        "steps": _int(req.get("steps", 0)), "to_position": _int(req.get("to_position", 0)),
        "spill": bool(req.get("spill", False)),
        "error_code": int(out.get("error_code", 0)), "position": int(out.get("position", 0)),
        "token": int(out.get("token", -1)), "margin": float(out.get("margin", math.nan)),
        "action": np.frombuffer(bytes.fromhex(out.get("action", "")), dtype="<f4").copy(),
        "made_capsule_id": out.get("capsule_id", ""), "state_digest": out.get("state_digest", ""),
    }
    for name in ("name", "tier", "requested_tier", "request_id", "source_id", "capsule_id", "prompt", "kind"):
        if not isinstance(fields[name], str):
            raise ValueError(f"journal entry {entry.seq} ({entry.kind}): {name} {fields[name]!r} is not a string")
    return typestore().types[ENTRY_TYPE](**fields)


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an int")
    return value


def entry_of(msg: Any) -> Entry:
    """The journal entry a JournalEntry holds: the request fields of its kind, the outputs it recorded."""
    if msg.kind not in KINDS:
        raise InvalidArgument(f"message seq={msg.seq}: unknown kind {msg.kind!r}")
    request: dict[str, Any] = {}
    for name in _REQUEST[msg.kind]:
        value = getattr(msg, name)
        request[name] = value.tolist() if isinstance(value, np.ndarray) else value
    if msg.kind == DECODE:
        if msg.temperature > 0:
            request["temperature"] = msg.temperature
            if msg.top_k:
                request["top_k"] = int(msg.top_k)
            if msg.top_p < 1:
                request["top_p"] = float(msg.top_p)
        if msg.has_seed:
            request["seed"] = int(msg.seed)
    outcome: dict[str, Any] = {"error_code": int(msg.error_code), "position": int(msg.position)}
    if msg.token >= 0:
        outcome["token"] = int(msg.token)
    if not math.isnan(msg.margin):
        outcome["margin"] = float(msg.margin)
    if len(msg.action):
        outcome["action"] = np.asarray(msg.action, dtype="<f4").tobytes().hex()
    if msg.made_capsule_id:
        outcome["capsule_id"] = msg.made_capsule_id
    if msg.state_digest:
        outcome["state_digest"] = msg.state_digest
    return Entry(int(msg.seq), msg.kind, request, outcome)


def session_message(session: SessionRecord, stamp_ns: int) -> Any:
    """The JournalSession of ``session``. Its prefill_chunk is not in the message: a node always
    runs the default, and an in-process session's record goes to a bag only with its journal."""
    if session.prefill_chunk != SessionRecord.prefill_chunk:
        raise InvalidArgument(f"a session record with prefill_chunk={session.prefill_chunk} has no JournalSession "
                              f"form (it carries the default, {SessionRecord.prefill_chunk}): replay it in process")
    fields = {name: getattr(session, name) for name in _SESSION_SCALARS}
    budgets = dict(session.budgets)
    kernels = dict(session.kernels)
    return typestore().types[SESSION_TYPE](
        header=_header(stamp_ns), **fields, signed_capsules=session.signed,
        budget_tiers=list(budgets), budget_bytes=np.asarray(list(budgets.values()), dtype=np.uint64),
        kernel_names=list(kernels), kernel_versions=list(kernels.values()),
        preloaded_ids=[i for i, _ in session.preloaded], preloaded_digests=[d for _, d in session.preloaded],
        joint_names=list(session.joint_names))


def session_of_message(msg: Any) -> SessionRecord:
    return SessionRecord(**{name: getattr(msg, name) for name in _SESSION_SCALARS}, signed=bool(msg.signed_capsules),
                         budgets=tuple(zip(msg.budget_tiers, (int(b) for b in msg.budget_bytes))),
                         kernels=tuple(zip(msg.kernel_names, msg.kernel_versions)),
                         preloaded=tuple(zip(msg.preloaded_ids, msg.preloaded_digests)),
                         joint_names=tuple(msg.joint_names))


class BagWriter:
    """Appends journal entries to a new MCAP bag as they are recorded, and any other message
    handed to ``write_message``; ``close`` finishes it. ``clock``: nanoseconds for the stamps
    (the node passes its own clock, so that use_sim_time is honoured). ``session`` None: a bag
    of other messages only, with no journal (``write_message``). ``flush_each``: every journal
    entry, and every message before it, is in the file when the call that appends it returns, so
    a recorder killed later loses none of them (``salvage`` reads such a bag); a bag written
    whole at once does not need it."""

    def __init__(self, path: str | Path, session: SessionRecord | None,
                 clock: Callable[[], int] | None = None, flush_each: bool = False) -> None:
        self.path = Path(path)
        self._flush_each = flush_each
        self._clock = clock or (lambda: time.time_ns())
        now = self._clock()
        # Made before the bag is opened: a record with no message form leaves no half-made bag.
        record = None if session is None else typestore().serialize_cdr(session_message(session, now), SESSION_TYPE)
        self._writer: Writer | None = Writer(self.path, version=9, storage_plugin=StoragePlugin.MCAP)
        self._writer.open()
        self._lock = threading.Lock()
        self._connections: dict[tuple[str, str], Any] = {}
        if record is not None:
            self._write(SESSION_TOPIC, SESSION_TYPE, record, now, flush=flush_each)

    def __call__(self, entry: Entry) -> None:
        now = self._clock()
        self._write(ENTRY_TOPIC, ENTRY_TYPE, typestore().serialize_cdr(entry_message(entry, now), ENTRY_TYPE), now,
                    flush=self._flush_each)

    def write_message(self, topic: str, msgtype: str, cdr: bytes, stamp_ns: int | None = None) -> None:
        """A message already serialized (CDR) on ``topic``, of ``msgtype`` as ROS names it
        (``pkg/msg/Name``, ``pkg/srv/Name_Event``, ``pkg/action/Name_Goal``)."""
        self._write(topic, msgtype, cdr, self._clock() if stamp_ns is None else stamp_ns)

    def _write(self, topic: str, msgtype: str, cdr: bytes, stamp_ns: int, flush: bool = False) -> None:
        with self._lock:
            if self._writer is None:
                return
            key = (topic, msgtype)
            if key not in self._connections:
                self._connections[key] = self._connect(topic, msgtype)
            self._writer.write(self._connections[key], stamp_ns, cdr)
            if flush:
                _flush(self._writer)

    def _connect(self, topic: str, msgtype: str) -> Any:
        if msgtype not in typestore().types:
            raise ValueError(f"{msgtype} is not a known type")
        return self._writer.add_connection(topic, msgtype, msgdef=schema_text(msgtype), rihs01=type_hash(msgtype))

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def _flush(writer: Writer) -> None:
    """Write out the chunk rosbags' MCAP writer holds in memory (it does so only past 1 MiB, or
    at close), and its file buffer. rosbags 0.11.9 (pinned) has no public call for it: this
    uses its storage plugin's own ``close_chunk``, which ``close`` calls too. A chunk per
    committed operation adds its index records to the file and to what the writer holds until
    it closes, a few hundred bytes, about what the session's journal keeps of each entry in
    memory anyway. The bytes are then the operating system's (written, not fsynced): a crash
    of the process loses none of them, a power cut may."""
    storage = writer.storage
    if storage.chunk.bio.tell():
        storage.close_chunk()
    storage.bio.flush()


def write_bag(path: str | Path, journal: Journal) -> Path:
    writer = BagWriter(path, journal.session)
    try:
        for entry in journal.entries:
            writer(entry)
    finally:
        writer.close()
    return Path(path)


def messages(path: str | Path, reader: Reader, connections: list) -> Iterator[tuple[Any, Any, bytes]]:
    """(connection, message, its serialized bytes) of each message on ``connections`` (not empty:
    rosbags reads every connection for an empty list), in log-time order; InvalidArgument naming
    one that is not its type."""
    for index, (connection, _, raw) in enumerate(reader.messages(connections=connections)):
        try:
            msg = deserialize(raw, connection.msgtype)
        except Exception as exc:   # rosbags raises several kinds on bytes that are not the type
            raise InvalidArgument(f"{path}: message {index} on {connection.topic} is not a "
                                  f"{connection.msgtype}: {exc}") from None
        yield connection, msg, raw


class _TypesFromStore(Reader):
    """A bag's reader whose connections carry no definition, so that AnyReader takes every type
    from its ``default_typestore``."""

    def open(self) -> None:
        super().open()
        self.connections[:] = [c._replace(msgdef=MessageDefinition(MessageDefinitionFormat.NONE, ""))
                               for c in self.connections]


def any_reader(path: str | Path) -> AnyReader:
    """rosbags' AnyReader over a bag of this package, deserializing with ``typestore()`` (Jazzy's
    types and this package's). AnyReader builds its types from the definitions a bag stores,
    and rosbags 0.11.9 cannot parse the one rosbag2 stores for a service event (a ``SRV:``
    section, in rosbag2's own bags too), so it would refuse every bag with service events."""
    reader = AnyReader([Path(path)], default_typestore=typestore())
    reader.readers = [_TypesFromStore(Path(path))]
    return reader


def is_journal_bag(path: str | Path) -> bool:
    """Whether a bag holds this package's journal (else it may be a recording of the node's topics)."""
    with Reader(Path(path)) as reader:
        return any(c.topic == ENTRY_TOPIC for c in reader.connections)


def read_bag(path: str | Path) -> Journal:
    """The journal in a bag; InvalidArgument naming the message if one is malformed."""
    journal = Journal()
    with Reader(Path(path)) as reader:
        connections = [c for c in reader.connections if c.topic in (SESSION_TOPIC, ENTRY_TOPIC)]
        if not any(c.topic == SESSION_TOPIC for c in connections):
            raise InvalidArgument(f"{path}: no {SESSION_TOPIC} message: not a flashrt journal bag")
        for c in connections:
            wanted = SESSION_TYPE if c.topic == SESSION_TOPIC else ENTRY_TYPE
            if c.msgtype != wanted:
                raise InvalidArgument(f"{path}: {c.topic} holds {c.msgtype}, not {wanted}: a journal bag of another "
                                      "format (record it again with this version)")
        entries = []
        for connection, msg, _ in messages(path, reader, connections):
            if connection.topic == SESSION_TOPIC:
                journal.session = session_of_message(msg)
            else:
                entries.append(entry_of(msg))
    # In the order of their seq, not of their stamps: those come from a clock, which may
    # step back during a session.
    entries.sort(key=lambda e: e.seq)
    for expected, entry in enumerate(entries):
        if entry.seq != expected:
            raise InvalidArgument(f"{path}: the journal has no entry seq {expected} (next is {entry.seq})")
    journal.entries.extend(entries)
    return journal
