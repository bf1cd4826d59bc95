"""Journal <-> rosbag2 MCAP bag, written and read with ``rosbags`` (pure Python, no ROS).

Topics (std_msgs/msg/String, JSON payloads):
  /flashrt/journal/session  one message: the engine the session ran on
  /flashrt/journal          one message per committed operation, in commit order

JSON in String keeps the bag readable by any rosbag2 tool and needs no custom
type registration; each payload carries its sequence number, so a reader can
name the exact message that differs.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from rosbags.rosbag2 import Reader, StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from ..errors import InvalidArgument
from ..serving.journal import KINDS, Entry, Journal

SESSION_TOPIC = "/flashrt/journal/session"
ENTRY_TOPIC = "/flashrt/journal"
_STRING = "std_msgs/msg/String"
_STORE = get_typestore(Stores.ROS2_JAZZY)


class BagWriter:
    """Appends journal entries to a new MCAP bag as they are recorded; ``close`` finishes it."""

    def __init__(self, path: str | Path, session: dict[str, Any]) -> None:
        self.path = Path(path)
        self._writer = Writer(self.path, version=9, storage_plugin=StoragePlugin.MCAP)
        self._writer.open()
        self._lock = threading.Lock()
        self._session = self._writer.add_connection(SESSION_TOPIC, _STRING, typestore=_STORE)
        self._entries = self._writer.add_connection(ENTRY_TOPIC, _STRING, typestore=_STORE)
        self._write(self._session, session)

    def __call__(self, entry: Entry) -> None:
        self._write(self._entries, {"seq": entry.seq, "kind": entry.kind, "request": entry.request,
                                    "outcome": entry.outcome})

    def _write(self, connection: Any, payload: dict[str, Any]) -> None:
        msg = _STORE.types[_STRING](data=json.dumps(payload, separators=(",", ":")))
        with self._lock:
            if self._writer is not None:
                self._writer.write(connection, time.time_ns(), _STORE.serialize_cdr(msg, _STRING))

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def write_bag(path: str | Path, journal: Journal) -> Path:
    writer = BagWriter(path, journal.session)
    try:
        for entry in journal.entries:
            writer(entry)
    finally:
        writer.close()
    return Path(path)


def read_bag(path: str | Path) -> Journal:
    """The journal in a bag; InvalidArgument naming the message if one is malformed."""
    journal = Journal()
    with Reader(Path(path)) as reader:
        connections = [c for c in reader.connections if c.topic in (SESSION_TOPIC, ENTRY_TOPIC)]
        if not any(c.topic == SESSION_TOPIC for c in connections):
            raise InvalidArgument(f"{path}: no {SESSION_TOPIC} message: not a flashrt journal bag")
        entries = []
        for index, (connection, _, raw) in enumerate(reader.messages(connections=connections)):
            try:
                payload = json.loads(_STORE.deserialize_cdr(raw, connection.msgtype).data)
            except (ValueError, AssertionError) as exc:
                raise InvalidArgument(f"{path}: message {index} on {connection.topic} is not JSON: {exc}") from None
            if connection.topic == SESSION_TOPIC:
                journal.session = payload
                continue
            if not isinstance(payload, dict) or payload.get("kind") not in KINDS or not isinstance(
                    payload.get("seq"), int) or isinstance(payload.get("seq"), bool):
                raise InvalidArgument(f"{path}: message {index} on {ENTRY_TOPIC} is not a journal entry "
                                      f"(kind {payload.get('kind')!r}, seq {payload.get('seq')!r})"
                                      if isinstance(payload, dict) else
                                      f"{path}: message {index} on {ENTRY_TOPIC} is not a journal entry")
            entries.append(payload)
    # In the order of their seq, not of their stamps: those come from the wall clock,
    # which may step back during a session.
    entries.sort(key=lambda p: p["seq"])
    for expected, payload in enumerate(entries):
        if payload["seq"] != expected:
            raise InvalidArgument(f"{path}: the journal has no entry seq {expected} (next is {payload['seq']})")
        journal.entries.append(Entry(payload["seq"], payload["kind"], payload["request"], payload["outcome"]))
    return journal
