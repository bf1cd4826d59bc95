"""The arena as the capsule layer sees it: a region table and the byte ranges a capsule copies."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from .info import RegionLike


@dataclass(frozen=True, slots=True)
class Layout:
    """What the store knows of the arena: regions and byte ranges, never layers."""

    regions: tuple[RegionLike, ...]
    fixed_bytes: int
    fingerprint: str
    table: tuple[dict, ...]
    # (offset, row bytes) of each per-token region, and the bytes of one row of all of them:
    # computed once, read by every snapshot.
    rows: tuple[tuple[int, int], ...] = field(init=False)
    row_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rows", tuple((r.offset, r.row_bytes) for r in self.regions if r.per_token))
        object.__setattr__(self, "row_bytes", sum(row for _, row in self.rows))

    @property
    def nbytes(self) -> int:
        """Where the last region ends: the least an arena buffer with this layout holds."""
        return max((r.offset + r.nbytes for r in self.regions), default=0)

    @property
    def max_position(self) -> int:
        """The rows each per-token region has room for (the arena's max_seq_len)."""
        return min((r.nbytes // r.row_bytes for r in self.regions if r.per_token), default=0)

    def ranges(self, position: int, start_position: int = 0) -> list[tuple[int, int]]:
        """The fixed block plus, for each per-token region, rows [start_position, position).

        Ranges that touch are merged (the first per-token region starts where the
        fixed block ends): each range is one copy on snapshot and restore.
        """
        out = [(0, self.fixed_bytes)]
        if position > start_position:
            for offset, row_bytes in self.rows:
                start, end = offset + start_position * row_bytes, offset + position * row_bytes
                if start == out[-1][1]:
                    out[-1] = (out[-1][0], end)
                else:
                    out.append((start, end))
        return out

    def ranges_bytes(self, position: int, start_position: int = 0) -> int:
        """The bytes ``ranges(position, start_position)`` cover, in closed form: a snapshot sizes
        its chunk with this, on its latency-critical path, so it builds no ranges to sum."""
        rows = position - start_position
        return self.fixed_bytes + (rows * self.row_bytes if rows > 0 else 0)

    def group_ranges(self, position: int, groups: Iterable[str]) -> list[tuple[int, int]]:
        wanted = set(groups)
        return [(r.offset, r.offset + r.live_bytes(position)) for r in self.regions if r.group in wanted]
