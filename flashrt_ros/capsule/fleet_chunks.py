"""How a capsule's bytes travel to the fleet tier: cut into chunks on the arena's row
boundaries, so that capsules along one lineage cut the token rows they share into the very
same chunks, and a chunk's name (its digest) says that it is already there.

A capsule's data is ``Layout.ranges(position)`` end to end: the fixed block, then each
per-token region's rows [0, position). Its chunks, in order, are that data cut in place:

- the fixed block, in pieces of at most ``most_bytes``;
- then, region by region, row block k of the region: its rows [k*R, min((k+1)*R, position)),
  in pieces of at most ``most_bytes`` (a block is one piece unless one row is larger).

So every chunk is one contiguous span of the data and of the arena, and the chunks laid end
to end are the data: a publish sends views of the capsule's bytes, a pull writes each chunk
where it lies, and one pass over the spans in order hashes the capsule digest and every
chunk's name at once (``digest.state_and_span_digests``).

Block k of a region holds the same bytes in every capsule that holds all its R rows and
descends from the same prefix (KV is append-only), so two capsules of one lineage name the
same chunks for their common full blocks; only each region's last, partial block is a
capsule's own. The fixed block (the recurrent, conv and MTP state) changes with every token
and is never shared along a lineage. The cut is a function of the layout, the position and
the chunking alone, which the manifest records: a reader computes it again and checks every
chunk's length against it.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
from blake3 import blake3

from ..digest import state_and_span_digests
from .layout import Layout

Span = tuple[int, int]   # bytes [start, end) of a capsule's data, or of the arena
DIGEST_CHARS = 64        # BLAKE3-256, hex


class Chunking(NamedTuple):
    """Rows per row block, and bytes per chunk at most."""

    rows: int
    most_bytes: int


def chunking_for(layout: Layout, chunk_rows: int, chunk_bytes: int) -> Chunking:
    """Blocks of ``chunk_rows`` rows, fewer where a block of the widest region's rows would
    pass ``chunk_bytes``."""
    widest = max((row for _, row in layout.rows), default=1)
    return Chunking(max(1, min(chunk_rows, chunk_bytes // widest)), chunk_bytes)


def wire_chunks(layout: Layout, position: int, chunking: Chunking) -> list[Span]:
    """The span of the capsule's data each chunk holds, in order: they tile the data."""
    return [(data, data + n) for data, _, n in _pieces(layout, position, chunking)]


def arena_chunks(layout: Layout, position: int, chunking: Chunking) -> list[Span]:
    """The span of the arena each chunk holds, in the order of ``wire_chunks``."""
    return [(arena, arena + n) for _, arena, n in _pieces(layout, position, chunking)]


def chunk_digests(layout: Layout, position: int, chunking: Chunking,
                  read: Callable[[int, int], object]) -> tuple[str, tuple[str, ...]]:
    """(the capsule digest, each chunk's name) of the capsule whose arena bytes ``read(start,
    end)`` gives, in one pass: the capsule digest is ``digest.state_digest``'s, since the
    chunks in order are the capsule's data."""
    return state_and_span_digests(arena_chunks(layout, position, chunking), read)


def chunk_bytes(data: np.ndarray, span: Span) -> memoryview:
    """The bytes of one chunk out of a capsule's data: a view, not a copy."""
    return memoryview(data[span[0]:span[1]])


def length(span: Span) -> int:
    return span[1] - span[0]


def digest(value: bytes | memoryview) -> str:
    """A chunk's name: BLAKE3-256 of its bytes, the hash the capsule digest uses. On every
    core, as ``digest.state_digest(every_core=True)``: a publish or a reader that names a
    chunk waits for it."""
    return blake3(value, max_threads=blake3.AUTO).hexdigest()


def _pieces(layout: Layout, position: int, chunking: Chunking) -> list[tuple[int, int, int]]:
    """(data offset, arena offset, bytes) of each chunk, in order."""
    rows, most = chunking
    out: list[tuple[int, int, int]] = []

    def cut(data: int, arena: int, n: int) -> None:
        for done in range(0, n, most):
            out.append((data + done, arena + done, min(most, n - done)))

    cut(0, 0, layout.fixed_bytes)
    data = layout.fixed_bytes
    for offset, row in layout.rows:
        for first in range(0, position, rows):
            n = (min(first + rows, position) - first) * row
            cut(data, offset + first * row, n)
            data += n
    return out
