"""What the store hands the engine for a snapshot or a restore: the byte copies to make between
the arena and a capsule's memory, and what the engine's state becomes. The engine carries a
plan out (``copy``); the store never calls back into it."""
from __future__ import annotations

from typing import Sequence

import torch

from .info import CapsuleInfo
from .memory import Chunk
from .pieces import Piece, Record, cut


def _copy(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)


class SnapshotPlan:
    """A new capsule's memory, allocated and not yet registered: ``copy`` fills it from the
    arena, then ``CapsuleStore.add`` makes it a capsule (or ``discard`` gives the memory back).

    ``pieces``: where each arena range lands (``chunk``'s bytes), plus the pieces of a base
    capsule the new one shares. A disk capsule's bytes land in ``chunk`` too, a host buffer the
    store writes to its file."""

    __slots__ = ("info", "log", "tier", "chunk", "ranges", "copied", "shared", "nbytes", "added")

    def __init__(self, info: CapsuleInfo, log_runs: tuple, tier: str, chunk: Chunk, ranges: list[tuple[int, int]],
                 copied: list[Piece], shared: list[Piece], nbytes: int) -> None:
        self.info, self.log, self.tier, self.chunk, self.ranges = info, log_runs, tier, chunk, ranges
        self.copied, self.shared, self.nbytes, self.added = copied, shared, nbytes, False

    def copy(self, buffer: torch.Tensor) -> None:
        """The arena's live bytes into the capsule's memory."""
        _copy([p.view() for p in self.copied], [buffer[s:e] for s, e in self.ranges])
        # The digest thread reads these bytes on the CPU: on a GPU it waits for these copies.
        self.chunk.copied_from(buffer.device)


class RestorePlan:
    """A capsule's bytes into the arena (``copy``), and the state they are: ``position`` and the
    boundary ``log`` the capsule was taken at. Everything that can fail (reading and verifying
    a disk capsule) happened when the plan was made, before the arena changes."""

    __slots__ = ("record", "copies")

    def __init__(self, record: Record, pieces: Sequence[Piece], ranges: Sequence[tuple[int, int]]) -> None:
        self.record = record
        self.copies = [(q.start, q.end, q.view()) for s, e in ranges for q in cut(pieces, s, e)]

    @property
    def position(self) -> int:
        return self.record.info.position

    @property
    def log(self) -> tuple:
        return self.record.log

    def copy(self, buffer: torch.Tensor) -> None:
        _copy([buffer[start:end] for start, end, _ in self.copies], [src for _, _, src in self.copies])

