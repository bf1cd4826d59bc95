"""Where a capsule's bytes are: pieces of immutable, reference-counted chunks, and the record
the store keeps per capsule."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

import torch

from .errors import CorruptCapsule
from .info import CapsuleInfo
from .memory import Chunk


class Piece(NamedTuple):
    """Arena bytes [start, end) are ``chunk.data[offset : offset + end - start]``."""

    start: int
    end: int
    chunk: Chunk
    offset: int

    def view(self) -> torch.Tensor:
        return self.chunk.data[self.offset:self.offset + self.end - self.start]


class Record:
    """A capsule inside the store: its info, where its bytes are, and its boundary log."""

    __slots__ = ("info", "pieces", "log", "last_used", "path", "file_info", "job", "wire")

    def __init__(self, info: CapsuleInfo, pieces: list[Piece], log_runs: tuple, path: Path | None = None) -> None:
        self.info, self.pieces, self.log, self.path = info, pieces, log_runs, path
        # A disk capsule: the info its file gave when it was loaded or written. Each later read
        # of the file must give it again (``info`` may differ: a name taken by an older capsule).
        self.file_info = info if path is not None else None
        self.last_used = time.monotonic()
        self.job = None   # the digest job pending (``digest_worker``); None: the digest is final
        # (chunking, its fleet chunks' names) hashed with the digest, or None: bytes never
        # change, so they stay true on every tier and for every fork.
        self.wire = None

    def pieces_in(self, start: int, end: int) -> list[Piece]:
        return cut(self.pieces, start, end)


def cut(pieces: Sequence[Piece], start: int, end: int) -> list[Piece]:
    """Sub-pieces covering arena bytes [start, end) (possibly none)."""
    out = []
    for p in pieces:
        s, e = max(p.start, start), min(p.end, end)
        if s < e:
            out.append(Piece(s, e, p.chunk, p.offset + s - p.start))
    return out


def read_pieces(pieces: Sequence[Piece], start: int, end: int) -> list:
    """Arena bytes [start, end) of ``pieces`` for the CPU to read, as NumPy arrays in order."""
    parts = [p.chunk.readable(p.offset, p.end - p.start) for p in cut(pieces, start, end)]
    if sum(p.size for p in parts) != end - start:
        raise CorruptCapsule(f"capsule pieces do not cover arena bytes [{start}, {end})")
    return parts


def laid_out(chunk: Chunk, ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """Pieces for ``ranges`` laid end to end in ``chunk``."""
    pieces, offset = [], 0
    for s, e in ranges:
        pieces.append(Piece(s, e, chunk, offset))
        offset += e - s
    return pieces


def chunks_of(pieces: Iterable[Piece]) -> list[Chunk]:
    """The chunks ``pieces`` lie in, each once, in order (by identity)."""
    seen: dict[int, Chunk] = {}
    for p in pieces:
        seen.setdefault(id(p.chunk), p.chunk)
    return list(seen.values())


def same_bytes_until(a: Sequence[Piece], b: Sequence[Piece], start: int, end: int) -> int:
    """The arena byte up to which ``a`` and ``b`` map [start, end) onto the very same chunk
    bytes (both sorted and touching); ``start`` if not even the first."""
    a, b = cut(a, start, end), cut(b, start, end)
    i = j = 0
    pos = start
    while pos < end and i < len(a) and j < len(b):
        pa, pb = a[i], b[j]
        if pa.start > pos or pb.start > pos or pa.chunk is not pb.chunk or \
                pa.offset - pa.start != pb.offset - pb.start:
            break
        pos = min(pa.end, pb.end)
        i += pos == pa.end
        j += pos == pb.end
    return pos
