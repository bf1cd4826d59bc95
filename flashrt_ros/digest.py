"""The one definition of a state digest, shared by the live arena and capsules.

blake2b-256 over each region's live bytes in region-table order; per-token
regions count only their first ``position`` rows. Two states with equal
digests are byte-identical wherever it matters.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Iterable, Protocol


class _Region(Protocol):
    offset: int
    group: str

    def live_bytes(self, position: int) -> int: ...


def state_digest(regions: Iterable[_Region], position: int, read: Callable[[int, int], object]) -> str:
    """``read(start, end)`` returns the bytes at arena offsets [start, end): one buffer, or a
    list of buffers in order (hashed one after another, which is the same as hashing them
    joined, without the copy)."""
    h = hashlib.blake2b(digest_size=32)
    for r in regions:
        n = r.live_bytes(position)
        if n:
            data = read(r.offset, r.offset + n)
            for part in data if isinstance(data, list) else (data,):
                h.update(part)
    return h.hexdigest()


def history_digest(regions: Iterable[_Region], position: int, read: Callable[[int, int], object]) -> str:
    """blake2b over the input history only (token ids and observations): what was fed, not what it did."""
    return state_digest([r for r in regions if getattr(r, "name", "") in ("meta.tokens", "meta.observations")],
                        position, read)
