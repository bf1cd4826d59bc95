"""What rollback needs: a log of committed boundaries and a ring of fixed-size state.

KV and the other per-token regions are append-only, so going back to an
earlier boundary only needs the fixed-size regions (recurrent, conv, meta)
as they were then, plus the position. The ring keeps those bytes for the
last ``depth`` boundaries, one copy per boundary, never any KV.

The log records how the state was built, as runs of (kind, start, count):
"prefill" runs (one prefill call each), "decode" and "step" runs. Replaying
a truncated log repeats the same calls, so the result is bit-identical to
an engine that made exactly those calls.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

PREFILL, DECODE, STEP = "prefill", "decode", "step"


class BoundaryLog:
    def __init__(self, runs: tuple = ()) -> None:
        self.runs: list[tuple[str, int, int]] = [tuple(r) for r in runs]

    def append(self, kind: str, start: int, count: int) -> None:
        last = self.runs[-1] if self.runs else None
        if kind != PREFILL and last is not None and last[0] == kind and last[1] + last[2] == start:
            self.runs[-1] = (kind, last[1], last[2] + count)
        else:
            self.runs.append((kind, start, count))

    def truncate(self, position: int) -> None:
        kept = []
        for kind, start, count in self.runs:
            if start >= position:
                break
            kept.append((kind, start, min(count, position - start)))
        self.runs = kept

    def between(self, begin: int, end: int) -> list[tuple[str, int, int]]:
        """The runs, cut to positions [begin, end)."""
        out = []
        for kind, start, count in self.runs:
            lo, hi = max(start, begin), min(start + count, end)
            if lo < hi:
                out.append((kind, lo, hi - lo))
        return out

    def snapshot(self) -> tuple:
        return tuple(self.runs)


@dataclass(slots=True)
class _Entry:
    position: int
    fixed: torch.Tensor                       # the fixed-size bytes at this boundary
    slot: int = -1                            # ring slot holding them, or -1 when borrowed
    owner: object = None                      # what the borrowed bytes belong to


class RollbackRing:
    """The fixed-size state of the last ``depth + 1`` boundaries (the current one included).

    Bytes are copied into ring slots at each boundary; a restored capsule's
    bytes are borrowed instead (no copy on the restore path) and copied only
    if that capsule's memory is about to be reused.
    """

    def __init__(self, depth: int, fixed_bytes: int, device: torch.device) -> None:
        self.depth = depth
        self._slots = torch.empty(depth + 1, fixed_bytes, dtype=torch.uint8, device=device)
        self._free = list(range(depth + 1))
        self.entries: deque[_Entry] = deque()

    def push(self, buffer: torch.Tensor, position: int) -> None:
        if len(self.entries) == self.depth + 1:
            self._drop(self.entries.popleft())
        slot = self._free.pop()
        view = self._slots[slot]
        view.copy_(buffer[:view.numel()], non_blocking=True)
        self.entries.append(_Entry(position, view, slot))

    def borrow(self, fixed: torch.Tensor, position: int, owner: object) -> None:
        """Make ``fixed`` (bytes of ``owner``, e.g. a capsule's chunk) the newest boundary."""
        if len(self.entries) == self.depth + 1:
            self._drop(self.entries.popleft())
        self.entries.append(_Entry(position, fixed, -1, owner))

    def unborrow(self, owner: object) -> None:
        """``owner`` is about to reuse its memory: copy what was borrowed from it into slots."""
        for entry in self.entries:
            if entry.slot < 0 and entry.owner is owner:
                entry.slot = self._free.pop()
                entry.fixed = self._slots[entry.slot].copy_(entry.fixed)
                entry.owner = None

    def clear(self) -> None:
        self._free.extend(entry.slot for entry in self.entries if entry.slot >= 0)
        self.entries.clear()

    def back(self, steps: int) -> _Entry:
        """Forget the newest ``steps`` boundaries and return the one that is now newest."""
        for _ in range(steps):
            self._drop(self.entries.pop())
        return self.entries[-1]

    def newest_at_or_before(self, position: int) -> int | None:
        """How many boundaries to go back to reach the newest one at or before ``position``."""
        for back, entry in enumerate(reversed(self.entries)):
            if entry.position <= position:
                return back
        return None

    def _drop(self, entry: _Entry) -> None:
        if entry.slot >= 0:
            self._free.append(entry.slot)
