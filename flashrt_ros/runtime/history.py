"""The engine's committed state as one immutable value, and the ring rollback steps back through.

KV and the other per-token regions are append-only, so going back to an earlier boundary only
needs the fixed-size regions (recurrent, conv, meta) as they were then, plus the position. The
ring keeps those bytes for the last ``depth`` boundaries, one copy per boundary, never any KV.

The log records how the state was built, as runs of (kind, start, count): "prefill" runs (one
prefill call each), "decode" and "step" runs. Replaying a truncated log repeats the same calls,
so the result is bit-identical to an engine that made exactly those calls.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

PREFILL, DECODE, STEP = "prefill", "decode", "step"

Run = tuple[str, int, int]


def appended(log: tuple[Run, ...], kind: str, start: int, count: int) -> tuple[Run, ...]:
    """``log`` with rows [start, start + count) of ``kind`` committed after it (decode and step
    rows join the run before them; each prefill is a run of its own)."""
    if log and kind != PREFILL and log[-1][0] == kind and log[-1][1] + log[-1][2] == start:
        return log[:-1] + ((kind, log[-1][1], log[-1][2] + count),)
    return log + ((kind, start, count),)


def truncated(log: tuple[Run, ...], position: int) -> tuple[Run, ...]:
    """The runs that built the first ``position`` rows."""
    return tuple((kind, start, min(count, position - start)) for kind, start, count in log if start < position)


def between(log: tuple[Run, ...], begin: int, end: int) -> list[Run]:
    """The runs, cut to positions [begin, end)."""
    out = []
    for kind, start, count in log:
        lo, hi = max(start, begin), min(start + count, end)
        if lo < hi:
            out.append((kind, lo, hi - lo))
    return out


class Kept(NamedTuple):
    """A boundary the ring can go back to: its position and the slot holding its fixed bytes."""

    position: int
    slot: int


class RingSlots:
    """The memory of the rollback ring: ``depth + 2`` slots of the fixed-size state, one
    allocation on the arena's device. A ring value (a tuple of ``Kept``, newest last) says which
    slot holds which boundary; ``saved`` writes only a slot the ring it is given does not use,
    so the state a failed call leaves in place keeps every boundary it names."""

    def __init__(self, depth: int, fixed_bytes: int, device: torch.device) -> None:
        self.depth = depth
        self._slots = torch.empty(depth + 2, fixed_bytes, dtype=torch.uint8, device=device)

    def saved(self, ring: tuple[Kept, ...], buffer: torch.Tensor, position: int) -> tuple[Kept, ...]:
        """``ring`` with ``buffer``'s fixed bytes, the boundary at ``position``, as its newest
        entry; the oldest go once more than ``depth + 1`` are kept."""
        used = {kept.slot for kept in ring}
        slot = next(i for i in range(self.depth + 2) if i not in used)
        view = self._slots[slot]
        view.copy_(buffer[:view.numel()], non_blocking=True)
        return ring[len(ring) - self.depth:] + (Kept(position, slot),) if len(ring) > self.depth else \
            ring + (Kept(position, slot),)

    def load(self, kept: Kept, buffer: torch.Tensor) -> None:
        """The fixed bytes of a kept boundary back into ``buffer``."""
        view = self._slots[kept.slot]
        buffer[:view.numel()].copy_(view, non_blocking=True)


class Base(NamedTuple):
    """The capsule the live state descends from: the live per-token rows [0:rows] equal its rows."""

    capsule: str
    rows: int


@dataclass(frozen=True, slots=True)
class Boundary:
    """Everything the engine knows about its live state beside the arena's bytes, replaced by
    one assignment at each committed boundary, restore, rollback or reset, with one of the
    transitions below.

    ``lineage`` changes whenever the state is replaced rather than extended. ``origin``: the
    capsule the last ``rollback(to_position)`` replayed from ("" otherwise)."""

    position: int = 0
    lineage: int = 0
    log: tuple[Run, ...] = ()
    ring: tuple[Kept, ...] = ()
    base: Base | None = None
    origin: str = ""


# ---- transitions: each takes a state and returns the next; the caller has written the arena ----
def committed(state: Boundary, kind: str, count: int, ring: tuple[Kept, ...]) -> Boundary:
    """``state`` extended by ``count`` rows of ``kind``; ``ring`` holds the new boundary."""
    return replace(state, position=state.position + count, log=appended(state.log, kind, state.position, count),
                   ring=ring)


def stepped_back(state: Boundary, index: int) -> Boundary:
    """``state`` back at its ring entry ``index``, whose fixed bytes the arena holds again."""
    kept = state.ring[index]
    base = None if state.base is None else Base(state.base.capsule, min(state.base.rows, kept.position))
    return replace(state, position=kept.position, log=truncated(state.log, kept.position),
                   ring=state.ring[:index + 1], base=base, origin="")


def moved(state: Boundary, position: int, log: tuple[Run, ...], ring: tuple[Kept, ...],
          base: Base | None = None, origin: str = "") -> Boundary:
    """Another boundary than ``state``'s, written into the arena whole: a restore, a reset, or
    where a replay starts. The lineage is the caller's to renew."""
    return replace(state, position=position, log=log, ring=ring, base=base, origin=origin)


def snapshotted(state: Boundary, capsule: str) -> Boundary:
    """``state``, whose live per-token rows [0:position] a new capsule now holds too."""
    return replace(state, base=Base(capsule, state.position))


def renewed(state: Boundary) -> Boundary:
    """``state`` as a replacement of the one before, not its extension."""
    return replace(state, lineage=state.lineage + 1)


def unknown(state: Boundary) -> Boundary:
    """After a replacement interrupted part-way: the arena is neither state, so no boundary the
    ring holds matches it and its rows are no capsule's."""
    return replace(state, lineage=state.lineage + 1, base=None, ring=())
