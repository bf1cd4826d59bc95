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

from mcap.records import Channel, DataEnd, Footer, Message, Schema
from mcap.stream_reader import StreamReader
from rosbags.rosbag2 import StoragePlugin, Writer

from ..errors import InvalidArgument
from .types import type_hash, typestore

MAGIC = b"\x89MCAP0\r\n"


@dataclass(frozen=True)
class Salvaged:
    """What was kept of an unfinished bag: ``messages`` complete ones over ``span_ns`` of log
    time; ``dropped_bytes`` of its data after the last complete record were not whole;
    ``skipped``: topics of types this package does not know, left out."""
    path: Path
    messages: int
    span_ns: int
    dropped_bytes: int
    why: str
    skipped: tuple[str, ...] = ()

    def describe(self) -> str:
        return (f"the recording ends early ({self.why}): read up to its last complete message, {self.messages} "
                f"messages over {self.span_ns / 1e9:.3f} s"
                + (f"; {self.dropped_bytes} bytes after it were not whole and are left out" if self.dropped_bytes else "")
                + (f"; topics of unknown types left out: {', '.join(self.skipped)}" if self.skipped else ""))


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
    was kept. InvalidArgument when nothing complete is left; one raised while the copy is read
    names ``bag``, not the copy."""
    bag = Path(bag)
    why = unfinished(bag)
    if not why:
        yield bag, None
        return
    with tempfile.TemporaryDirectory(prefix="flashrt-salvaged-") as folder:
        copy = Path(folder) / bag.name
        salvaged = salvage(bag, copy, why)
        try:
            yield copy, salvaged
        except InvalidArgument as exc:
            raise InvalidArgument(str(exc).replace(str(copy), str(bag))) from None


def salvage(bag: Path, into: Path, why: str) -> Salvaged:
    """Every message of ``bag``'s MCAP file up to its last complete record, written into a new
    bag at ``into`` as it is read."""
    (source,) = sorted(bag.glob("*.mcap"))
    schemas: dict[int, Schema] = {}
    channels: dict[int, Channel] = {}
    connections: dict[int, object] = {}
    skipped: set[str] = set()
    count, first, last = 0, None, 0
    size = source.stat().st_size
    complete = 0   # bytes of the data section read as whole records
    writer = Writer(into, version=9, storage_plugin=StoragePlugin.MCAP)
    writer.open()
    try:
        with source.open("rb") as f:
            for record in _whole_records(StreamReader(f, validate_crcs=True, record_size_limit=size)):
                if isinstance(record, (DataEnd, Footer)):   # the data section is whole
                    complete = size
                    break
                if isinstance(record, Schema):
                    schemas[record.id] = record
                elif isinstance(record, Channel):
                    channels[record.id] = record
                elif isinstance(record, Message):
                    if record.channel_id not in connections:
                        connections[record.channel_id] = _connect(writer, channels, schemas, record.channel_id,
                                                                  bag, skipped)
                    if connections[record.channel_id] is not None:
                        writer.write(connections[record.channel_id], record.log_time, record.data)
                        count += 1
                        first = record.log_time if first is None else min(first, record.log_time)
                        last = max(last, record.log_time)
                complete = f.tell()
    finally:
        writer.close()
    if not count:
        raise InvalidArgument(f"{bag}: {why}, and no complete message is left in {source.name}")
    return Salvaged(into, count, last - first, size - complete, why, tuple(sorted(skipped)))


def _whole_records(reader: StreamReader) -> Iterator[object]:
    """The records ``reader`` parses, up to the first that does not: where the file was cut (mcap
    raises EndOfFile, struct.error or a decompressor's own error there, so any error ends it)."""
    records = reader.records
    while True:
        try:
            yield next(records)
        except StopIteration:
            return
        except Exception:   # noqa: BLE001: see the docstring
            return


def _connect(writer: Writer, channels: dict[int, Channel], schemas: dict[int, Schema], channel_id: int,
             bag: Path, skipped: set[str]):
    """The new bag's connection for a channel, None (its topic named in ``skipped``) for a type
    this package does not know."""
    channel = channels.get(channel_id)
    schema = schemas.get(channel.schema_id) if channel is not None else None
    if channel is None or schema is None:
        raise InvalidArgument(f"{bag}: a message on channel {channel_id}, whose channel or schema was not recorded")
    if schema.name not in typestore().types:
        skipped.add(channel.topic)
        return None
    return writer.add_connection(channel.topic, schema.name, msgdef=schema.data.decode(),
                                 rihs01=type_hash(schema.name), serialization_format=channel.message_encoding)
