"""A bag that a crash left unfinished, read up to its last complete message, as ``ros2 bag
reindex`` would.

A rosbag2 writer puts ``metadata.yaml`` beside the MCAP file, and the MCAP's summary and footer
at its end, only when it closes. A recorder killed mid-session leaves neither, and ``rosbags``
refuses such a bag whole. ``complete_bag`` reads the MCAP's records in order instead, keeps every
message of every chunk that was written in full, and writes them into a new bag of its own: the
original folder is never changed. What was lost is said in words for the user.
"""
from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from mcap.exceptions import McapError
from mcap.records import Channel, DataEnd, Footer, Message, Schema
from mcap.stream_reader import StreamReader
from rosbags.rosbag2 import StoragePlugin, Writer

from ..errors import InvalidArgument
from .types import type_hash, typestore

MAGIC = b"\x89MCAP0\r\n"


@dataclass(frozen=True)
class Salvaged:
    """What was kept of an unfinished bag: ``messages`` complete ones, the last logged at
    ``last_log_time_ns``; ``dropped_bytes`` after the last complete record were not usable."""
    path: Path
    messages: int
    last_log_time_ns: int
    dropped_bytes: int
    why: str

    def describe(self) -> str:
        return (f"the recording ends early ({self.why}): read up to its last complete message, {self.messages} "
                f"messages, the last logged at {self.last_log_time_ns / 1e9:.3f} s"
                + (f"; {self.dropped_bytes} bytes after it were incomplete and left out" if self.dropped_bytes else ""))


def unfinished(bag: Path) -> str:
    """Why the bag folder was left unfinished by its writer ('' when it was closed)."""
    if not bag.is_dir():
        return ""
    files = sorted(bag.glob("*.mcap"))
    if len(files) != 1:
        return ""   # none, or a split bag: left to rosbags, which names what it lacks
    if not (bag / "metadata.yaml").exists():
        return "no metadata.yaml"
    with files[0].open("rb") as f:
        size = f.seek(0, 2)
        f.seek(max(0, size - len(MAGIC)))
        if size < 2 * len(MAGIC) or f.read() != MAGIC:
            return "its MCAP file has no footer"
    return ""


@contextlib.contextmanager
def complete_bag(bag: str | Path) -> Iterator[tuple[Path, Salvaged | None]]:
    """The bag to read: ``bag`` itself when its writer closed it, else a copy (in a temporary
    folder that lives as long as the context) of every complete message it holds, with what
    was kept. InvalidArgument when nothing complete is left."""
    bag = Path(bag)
    why = unfinished(bag)
    if not why:
        yield bag, None
        return
    with tempfile.TemporaryDirectory(prefix="flashrt-salvaged-") as folder:
        salvaged = salvage(bag, Path(folder) / bag.name, why)
        yield salvaged.path, salvaged


def salvage(bag: Path, into: Path, why: str) -> Salvaged:
    """Every message of ``bag``'s MCAP file up to its last complete record, written into a new
    bag at ``into``."""
    (source,) = sorted(bag.glob("*.mcap"))
    schemas: dict[int, Schema] = {}
    channels: dict[int, Channel] = {}
    kept: list[Message] = []
    size = source.stat().st_size
    complete = 0   # bytes of the file read as whole records
    with source.open("rb") as f:
        reader = StreamReader(f, validate_crcs=True, record_size_limit=size)
        try:
            for record in reader.records:
                if isinstance(record, (DataEnd, Footer)):
                    complete = size
                    break
                if isinstance(record, Schema):
                    schemas[record.id] = record
                elif isinstance(record, Channel):
                    channels[record.id] = record
                elif isinstance(record, Message):
                    kept.append(record)
                complete = f.tell()
        except (McapError, ValueError, EOFError):   # a cut record: what came before it stands
            pass
    if not kept:
        raise InvalidArgument(f"{bag}: {why}, and no complete message is left in {source.name}")
    writer = Writer(into, version=9, storage_plugin=StoragePlugin.MCAP)
    writer.open()
    try:
        connections = {}
        for message in kept:
            if message.channel_id not in connections:
                connections[message.channel_id] = _connect(writer, channels, schemas, message.channel_id, bag)
            writer.write(connections[message.channel_id], message.log_time, message.data)
    finally:
        writer.close()
    return Salvaged(into, len(kept), max(m.log_time for m in kept), size - complete, why)


def _connect(writer: Writer, channels: dict[int, Channel], schemas: dict[int, Schema], channel_id: int,
             bag: Path):
    channel = channels.get(channel_id)
    schema = schemas.get(channel.schema_id) if channel is not None else None
    if channel is None or schema is None:
        raise InvalidArgument(f"{bag}: a message on channel {channel_id}, whose channel or schema was not recorded")
    if schema.name not in typestore().types:
        raise InvalidArgument(f"{bag}: topic {channel.topic} holds {schema.name}, a type this package does not know")
    return writer.add_connection(channel.topic, schema.name, msgdef=schema.data.decode(),
                                 rihs01=type_hash(schema.name), serialization_format=channel.message_encoding)
