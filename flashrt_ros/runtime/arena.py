"""The state arena: ONE allocation per device holding every piece of execution state.

Each state tensor is a named view at a fixed byte offset, so a captured CUDA
graph keeps pointing at valid memory across restores, and a capsule is simply
the arena's live byte ranges plus this region table.

Layout rule: fixed-size regions come first and sit back to back (one range);
then the per-token regions, each position-major (row p holds everything for
token p), so the live prefix [0:position] of each is one contiguous range.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from ..hugepages import empty_huge

GROUPS = ("kv", "recurrent", "conv", "mtp", "meta")
_ALIGN = 256  # bytes; keeps every view aligned for vector loads and cudaMemcpy


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """What the model asks for: a name, a group, a dtype and a shape.

    ``per_token`` regions have the sequence axis first; only their first
    ``position`` rows are live.
    """

    name: str
    group: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    per_token: bool = False

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"region {self.name!r}: group {self.group!r} not in {GROUPS}")


@dataclass(frozen=True, slots=True)
class Region:
    """A placed region: the spec plus its byte range inside the arena."""

    name: str
    group: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    per_token: bool

    @property
    def row_bytes(self) -> int:
        """Bytes per token for a per-token region (its whole size otherwise)."""
        return self.nbytes // self.shape[0] if self.per_token else self.nbytes

    def live_bytes(self, position: int) -> int:
        return position * self.row_bytes if self.per_token else self.nbytes

    def as_dict(self) -> dict:
        return {"name": self.name, "group": self.group, "dtype": str(self.dtype).removeprefix("torch."),
                "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
                "per_token": self.per_token}


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class StateArena:
    """One byte buffer and the named views into it."""

    def __init__(self, specs: Iterable[RegionSpec], device: torch.device | str = "cpu", pin: bool = False) -> None:
        specs = list(specs)
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate region names in {names}")
        ordered = [s for s in specs if not s.per_token] + [s for s in specs if s.per_token]
        regions, offset = [], 0
        for spec in ordered:
            nbytes = spec.dtype.itemsize
            for dim in spec.shape:
                nbytes *= dim
            offset = _aligned(offset)
            regions.append(Region(spec.name, spec.group, spec.dtype, tuple(spec.shape), offset, nbytes, spec.per_token))
            offset += nbytes
        self.device = torch.device(device)
        self.nbytes = _aligned(offset)
        # Zeroed once: the initial state of every recurrence is zero, and unused
        # padding must hash the same on every machine.
        self.buffer = empty_huge((self.nbytes,), torch.uint8, self.device).zero_()
        if pin and self.device.type == "cpu" and torch.cuda.is_available():
            self.buffer = self.buffer.pin_memory()
        self.regions: tuple[Region, ...] = tuple(regions)
        self._by_name = {r.name: r for r in regions}
        self.views: dict[str, torch.Tensor] = {r.name: self._view(r) for r in regions}
        self.fixed_bytes = max((r.offset + r.nbytes for r in regions if not r.per_token), default=0)

    def _view(self, region: Region, base: torch.Tensor | None = None) -> torch.Tensor:
        raw = (self.buffer if base is None else base)[region.offset:region.offset + region.nbytes]
        return raw.view(region.dtype).view(region.shape)

    def fixed_views(self, image: torch.Tensor) -> dict[str, torch.Tensor]:
        """The fixed-size regions' views over ``image``, a uint8 tensor of ``fixed_bytes`` that
        holds (or will hold) a copy of the arena's fixed block, laid out as it is."""
        if image.dtype != torch.uint8 or image.shape != (self.fixed_bytes,):
            raise ValueError(f"a fixed-block image is uint8 [{self.fixed_bytes}], got {image.dtype} "
                             f"{tuple(image.shape)}")
        return {r.name: self._view(r, image) for r in self.regions if not r.per_token}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.views[name]

    def region(self, name: str) -> Region:
        return self._by_name[name]

    @property
    def region_table(self) -> tuple[dict, ...]:
        return tuple(r.as_dict() for r in self.regions)

    def layout_fingerprint(self) -> str:
        """Hash of names, groups, dtypes, shapes and byte ranges: two arenas with the
        same fingerprint can exchange bytes."""
        canonical = json.dumps(self.region_table, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()

    def live_ranges(self, position: int, groups: Iterable[str] | None = None) -> list[tuple[int, int]]:
        """Byte ranges (start, end) holding live state at ``position``, adjacent ones merged.

        With every group this is 1 range for the fixed regions plus 1 per
        per-token region: the copies a snapshot has to make.
        """
        wanted = set(GROUPS if groups is None else groups)
        ranges: list[tuple[int, int]] = []
        for r in self.regions:
            if r.group not in wanted:
                continue
            start, end = r.offset, r.offset + r.live_bytes(position)
            if end == start:
                continue
            if ranges and not r.per_token and _aligned(ranges[-1][1]) >= start:
                ranges[-1] = (ranges[-1][0], end)
            else:
                ranges.append((start, end))
        return ranges

    def live_views(self, position: int) -> Iterator[tuple[Region, torch.Tensor]]:
        """Each region with the view of its live part."""
        for r in self.regions:
            view = self.views[r.name]
            yield r, (view[:position] if r.per_token else view)

    def read(self, start: int, end: int):
        """Host bytes at arena offsets [start, end) (a device-to-host copy on CUDA)."""
        return self.buffer[start:end].cpu().numpy()
