"""This package's ROS interfaces as rosbags types, read from their .msg, .srv and .action files
(no ROS imports): bags are written and read with the real types, as rosbag2 would store them.

Each service Foo gives Foo_Request, Foo_Response and, as Jazzy's service introspection
publishes it on ``<service>/_service_event``, Foo_Event, all under ROS's names
(``pkg/srv/Foo_Event``, where rosbags' own parser would file them under ``pkg/srv/msg/``); the
Generate action gives Generate_Goal, Generate_Result and Generate_Feedback.

A bag names each topic's type with its definition and its RIHS01 hash as rosbag2 on Jazzy
writes them (``schema_text``, ``type_hash``): the .msg files as they are, and for a service
event the service's own file, which rosbags' high-level reader cannot parse (docs/ros.md says
how to read such a bag).
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

from ..resources import PACKAGE, package_file, share_file

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
    """Jazzy's standard types plus this package's, every one under the name ROS gives it."""
    store = get_typestore(Stores.ROS2_JAZZY)
    # rosidl reads a .msg ``char`` as uint8; rosbags' Jazzy store keeps char, which gives
    # ServiceEventInfo (and every service event) another type hash than ROS's.
    consts, fields = store.fielddefs[_EVENT_INFO]
    store.fielddefs[_EVENT_INFO] = (consts, [(name, _char_as_uint8(desc)) for name, desc in fields])
    types: dict = {}
    for name, text in definitions(interface_dir()).items():
        types.update(get_types_from_msg(text, name))
    store.register({_ros_name(name): (consts, [(field, _renamed(desc)) for field, desc in fields])
                    for name, (consts, fields) in types.items()})
    return store


_EVENT_INFO = "service_msgs/msg/ServiceEventInfo"


def _ros_name(name: str) -> str:
    """``pkg/srv/msg/Foo_Request`` (where rosbags' parser files a service's types) as ROS names it."""
    return name.replace("/srv/msg/", "/srv/")


def _renamed(desc: Any) -> Any:
    """A field's type with every nested type under its ROS name."""
    kind, args = desc
    if isinstance(args, str):
        return kind, _ros_name(args)
    if isinstance(args, tuple) and len(args) == 2 and isinstance(args[0], tuple):
        return kind, (_renamed(args[0]), args[1])
    return desc


def _char_as_uint8(desc: Any) -> Any:
    kind, args = desc
    if args == ("char", 0):
        return kind, ("uint8", 0)
    if isinstance(args, tuple) and len(args) == 2 and isinstance(args[0], tuple):
        return kind, (_char_as_uint8(args[0]), args[1])
    return desc


def type_hash(msgtype: str) -> str:
    """The RIHS01 hash ROS gives ``msgtype`` (rosidl's type description hash)."""
    return typestore().hash_rihs01(msgtype)


_RULE = "=" * 80 + "\n"
_PRIMITIVES = frozenset(("bool", "byte", "char", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32",
                         "uint32", "int64", "uint64", "string"))   # rosbag2's list
_FIELD_TYPE = re.compile(r"(?:^|\n)\s*([a-zA-Z0-9_/]+)(?:\[[^\]]*\])?\s+")


def schema_text(msgtype: str) -> str:
    """The definition a bag stores for ``msgtype``, as rosbag2 on Jazzy writes it: the type's
    .msg file as it is, then each message type it uses, depth first and once each, as
    ``MSG: pkg/Type`` and that type's file. A service event's is its service's: ``SRV:
    pkg/srv/Foo`` and the .srv file, then the same. An action's parts (which rosbag2 finds no
    file for) get rosbags' text of their fields."""
    package, kind, name = msgtype.split("/")
    if kind == "msg":
        head, text = "", _msg_file(msgtype)
    elif kind == "srv" and name.endswith("_Event") and package == PACKAGE:
        service = name[:-len("_Event")]
        head, text = _RULE + f"SRV: {package}/srv/{service}\n", (interface_dir() / "srv" / f"{service}.srv").read_text()
    else:
        return typestore().generate_msgdef(msgtype, ros_version=2)[0]
    seen: set[str] = set()

    def uses(text: str, context: str) -> str:
        out = ""
        for dep in sorted(_dependencies(text, context)):
            if dep not in seen:
                seen.add(dep)
                own = _msg_file(dep)
                out += "\n" + _RULE + f"MSG: {dep}\n" + own + uses(own, dep.split("/")[0])
        return out

    return head + text + uses(text, package)


def _dependencies(text: str, package: str) -> set[str]:
    """The message types a .msg or .srv file uses, as rosbag2 names them: as the file spells
    them, a bare name with the file's package before it (``pkg/Type``)."""
    found = set()
    for match in _FIELD_TYPE.finditer(text):
        kind = match.group(1)
        if kind not in _PRIMITIVES:
            found.add(kind if "/" in kind else f"{package}/{kind}")
    return found


def _msg_file(msgtype: str) -> str:
    """The .msg file of ``pkg/Type`` or ``pkg/msg/Type``: this package's, or another's from an
    installed ROS (AMENT_PREFIX_PATH); without one, rosbags' text of the same fields."""
    package, name = msgtype.split("/")[0], msgtype.split("/")[-1]
    path = interface_dir() / "msg" / f"{name}.msg" if package == PACKAGE else share_file(package, f"msg/{name}.msg")
    if path is not None:
        return path.read_text()
    text, _ = typestore().generate_msgdef(f"{package}/msg/{name}", ros_version=2)
    return text.split("\n" + _RULE)[0]


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
    return bytes(typestore().serialize_cdr(message, typename))


def _parse(raw: bytes | memoryview, typename: str) -> tuple[Any, int]:
    """The message, and how many bytes are left after its last field."""
    store = typestore()
    data = bytes(raw)
    if len(data) < 4 or data[:2] not in (b"\x00\x00", b"\x00\x01"):
        raise SerdeError(f"invalid or unsupported CDR encapsulation for {typename!r}")
    msgdef = store.get_msgdef(typename)
    func = msgdef.deserialize_cdr_le if data[1] else msgdef.deserialize_cdr_be
    try:
        message, pos = func(data[4:], 0, msgdef.cls, store)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise SerdeError(f"could not deserialize {typename!r}: {exc}") from exc
    return message, len(data) - 4 - pos
