"""How a capsule's bytes travel to the fleet tier: cut into chunks on the arena's row
boundaries, so that capsules along one lineage cut the token rows they share into the very
same chunks, and a chunk's name (its digest) says that it is already there.

A capsule's data is ``Layout.ranges(position)`` end to end: the fixed block, then each
per-token region's rows [0, position). Its chunks, in order:

- the fixed block, in pieces of at most ``most_bytes``;
- row block k: rows [k*R, min((k+1)*R, position)) of every per-token region, joined in region
  order, in pieces of at most ``most_bytes`` (a block is one piece unless one row is larger).

Block k holds the same bytes in every capsule that holds all its R rows and descends from the
same prefix (KV is append-only), so two capsules of one lineage name the same chunks for their
common full blocks; only a capsule's last, partial block is its own. The fixed block (the
recurrent, conv and MTP state) changes with every token and is never shared along a lineage.
The cut is a function of the layout, the position and the chunking alone, which the manifest
records: a reader computes it again and checks every chunk's length against it.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
from blake3 import blake3

from .layout import Layout

Span = tuple[int, int]   # bytes [start, end) of a capsule's data (not arena offsets)
DIGEST_CHARS = 64        # BLAKE3-256, hex


class Chunking(NamedTuple):
    """Rows per row block, and bytes per chunk at most."""

    rows: int
    most_bytes: int


def chunking_for(layout: Layout, chunk_rows: int, chunk_bytes: int) -> Chunking:
    """Blocks of ``chunk_rows`` rows, fewer where a block of them would pass ``chunk_bytes``."""
    return Chunking(max(1, min(chunk_rows, chunk_bytes // max(1, layout.row_bytes))), chunk_bytes)


def wire_chunks(layout: Layout, position: int, chunking: Chunking) -> list[list[Span]]:
    """The spans of the capsule's data each chunk holds, chunk by chunk, in order."""
    rows, most = chunking
    chunks = _cut([(0, layout.fixed_bytes)], most)
    if position > 0:
        ranges = layout.ranges(position)
        bases = [(_data_offset(ranges, offset), row_bytes) for offset, row_bytes in layout.rows]
        for first in range(0, position, rows):
            end = min(first + rows, position)
            chunks += _cut([(base + first * row, base + end * row) for base, row in bases], most)
    return chunks


def chunk_bytes(data: np.ndarray, spans: Sequence[Span]) -> bytes | memoryview:
    """The bytes of one chunk out of a capsule's data: a view where it is one span."""
    if len(spans) == 1:
        s, e = spans[0]
        return memoryview(data[s:e])
    return b"".join(memoryview(data[s:e]) for s, e in spans)


def place(data: np.ndarray, spans: Sequence[Span], value: bytes) -> None:
    """Copy a chunk's bytes (checked to be as long as ``spans``) into the capsule's data."""
    done = 0
    for s, e in spans:
        data[s:e] = np.frombuffer(value, dtype=np.uint8, count=e - s, offset=done)
        done += e - s


def length(spans: Sequence[Span]) -> int:
    return sum(e - s for s, e in spans)


def digest(value: bytes | memoryview) -> str:
    """A chunk's name: BLAKE3-256 of its bytes, the hash the capsule digest uses. On every
    core, as ``digest.state_digest(every_core=True)``: a publish waits for it."""
    return blake3(value, max_threads=blake3.AUTO).hexdigest()


def _cut(spans: Sequence[Span], most: int) -> list[list[Span]]:
    """``spans``, end to end, in chunks of at most ``most`` bytes (the last may be shorter)."""
    out: list[list[Span]] = []
    current: list[Span] = []
    size = 0
    for s, e in spans:
        while s < e:
            take = min(e - s, most - size)
            current.append((s, s + take))
            size += take
            s += take
            if size == most:
                out.append(current)
                current, size = [], 0
    if current:
        out.append(current)
    return out


def _data_offset(ranges: Sequence[Span], arena_offset: int) -> int:
    """Where arena byte ``arena_offset`` lies in a capsule's data (``ranges`` end to end)."""
    done = 0
    for s, e in ranges:
        if s <= arena_offset < e:
            return done + arena_offset - s
        done += e - s
    raise ValueError(f"arena offset {arena_offset} is in none of the capsule's ranges")
