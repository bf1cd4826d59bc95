"""This package's ROS interfaces as rosbags types, read from their .msg, .srv and .action files
(no ROS imports): bags are written and read with the real types, as rosbag2 would store them.

Each service Foo gives Foo_Request, Foo_Response and, as Jazzy's service introspection
publishes it on ``<service>/_service_event``, Foo_Event; the Generate action gives
Generate_Goal, Generate_Result and Generate_Feedback.
"""
from __future__ import annotations

import functools
import re
import struct
from pathlib import Path
from typing import Any

from rosbags.serde import SerdeError
from rosbags.typesys import Stores, get_typestore, get_types_from_msg
from rosbags.typesys.store import Typestore

from ..resources import PACKAGE, package_file

_PARTS = {"srv": ("Request", "Response"), "action": ("Goal", "Result", "Feedback")}


def interface_dir() -> Path:
    """Where the interface files are (msg/, srv/, action/)."""
    return package_file("msg/JournalEntry.msg").parents[1]


def definitions(folder: Path) -> dict[str, str]:
    """Type name -> message definition, for every interface of the package."""
    found: dict[str, str] = {}
    for path in sorted((folder / "msg").glob("*.msg")):
        found[f"{PACKAGE}/msg/{path.stem}"] = path.read_text()
    own = {path.stem for path in (folder / "msg").glob("*.msg")}
    for kind, parts in _PARTS.items():
        for path in sorted((folder / kind).glob(f"*.{kind}")):
            sections = path.read_text().split("\n---")
            if len(sections) != len(parts):
                raise ValueError(f"{path}: {len(sections)} sections, a .{kind} has {len(parts)}")
            for part, text in zip(parts, sections):
                found[f"{PACKAGE}/{kind}/{path.stem}_{part}"] = _qualified(text.lstrip("-\n"), own)
            if kind == "srv":
                found[f"{PACKAGE}/srv/{path.stem}_Event"] = event_definition(f"{PACKAGE}/srv/{path.stem}")
    return found


def _qualified(text: str, own: set[str]) -> str:
    """A service's or action's fields of this package's message types, named in full: ROS reads
    a bare ``CapsuleInfo`` there as flashrt_ros/msg/CapsuleInfo, rosbags would look in srv/."""
    return re.sub(r"^(\s*)([A-Z]\w*)(?=[\[\s])", lambda m: m.group(1) + (f"{PACKAGE}/msg/{m.group(2)}"
                  if m.group(2) in own else m.group(2)), text, flags=re.MULTILINE)


def event_definition(service: str) -> str:
    """The message a service's introspection publishes: its event info, then at most one request
    and one response (which are filled depends on the event type and introspection level)."""
    return (f"service_msgs/msg/ServiceEventInfo info\n{service}_Request[<=1] request\n"
            f"{service}_Response[<=1] response\n")


@functools.cache
def typestore() -> Typestore:
    """Jazzy's standard types plus this package's."""
    store = get_typestore(Stores.ROS2_JAZZY)
    types: dict = {}
    for name, text in definitions(interface_dir()).items():
        types.update(get_types_from_msg(text, name))
    store.register(types)
    return store


def stored_name(msgtype: str) -> str:
    """The name rosbags keeps a type under: a service's types under ``pkg/srv/msg/``, not ROS's ``pkg/srv/``."""
    package, kind, name = msgtype.split("/")
    return f"{package}/srv/msg/{name}" if kind == "srv" else msgtype


def deserialize(raw: bytes | memoryview, typename: str) -> Any:
    """A CDR message of ``typename``. rosbags refuses more than 3 bytes after the last field;
    rmw_fastrtps pads a message to 8-byte alignment (a JointState whose last sequence is empty
    ends with 4), so up to 7 are taken as padding here. SerdeError for anything else."""
    message, after = _parse(raw, typename)
    if after > 7:
        raise SerdeError(f"CDR message size mismatch for {typename!r}: {after} bytes after its fields")
    return message


def canonical(serialized: bytes | memoryview, typename: str) -> bytes:
    """``serialized`` (a message of ``typename`` as rclpy's serialize_message gives it) as rosbags
    lays it out, every padding byte zero. serialize_message returns a buffer sized for the
    message's worst-case alignment, whose padding and tail are left as the allocator found them
    (a JointTrajectoryPoint with three empty arrays ends with 12 such bytes): written as they
    are, a bag would hold bytes that differ per run and that rosbags refuses to read."""
    message, _ = _parse(serialized, typename)
    return bytes(typestore().serialize_cdr(message, stored_name(typename)))


def _parse(raw: bytes | memoryview, typename: str) -> tuple[Any, int]:
    """The message, and how many bytes are left after its last field."""
    store = typestore()
    data = bytes(raw)
    if len(data) < 4 or data[:2] not in (b"\x00\x00", b"\x00\x01"):
        raise SerdeError(f"invalid or unsupported CDR encapsulation for {typename!r}")
    msgdef = store.get_msgdef(stored_name(typename))
    func = msgdef.deserialize_cdr_le if data[1] else msgdef.deserialize_cdr_be
    try:
        message, pos = func(data[4:], 0, msgdef.cls, store)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise SerdeError(f"could not deserialize {typename!r}: {exc}") from exc
    return message, len(data) - 4 - pos
