"""The one definition of a state digest, shared by the live arena and capsules.

A state's digest is BLAKE3-256 over exactly the bytes a capsule of it stores, in order: the
arena's fixed-size block whole, then each per-token region's first ``position`` rows
(``capsule.Layout.ranges``). So one pass over a capsule's bytes, as they lie in memory or in
its file, checks all of them. BLAKE3 because a capsule file is hashed on the restore path and
it runs several times as fast as BLAKE2b while being as strong (``bench.capsules`` prints the
hash beside each copy). The history hash is BLAKE3 over the input history alone (token ids
and observations): what was fed, not what it did.
"""
from __future__ import annotations

from typing import Callable, Iterable, Protocol

from blake3 import blake3

HISTORY_REGIONS = ("meta.tokens", "meta.observations")


class _Region(Protocol):
    name: str
    offset: int

    def live_bytes(self, position: int) -> int: ...


def _hash(spans: Iterable[tuple[int, int]], read: Callable[[int, int], object], every_core: bool) -> str:
    """``read(start, end)`` returns the bytes at arena offsets [start, end): one buffer, or a
    list of buffers in order (hashed one after another, which is hashing them joined)."""
    h = blake3(max_threads=blake3.AUTO if every_core else 1)
    for start, end in spans:
        if end > start:
            data = read(start, end)
            for part in data if isinstance(data, list) else (data,):
                h.update(part)
    return h.hexdigest()


def state_digest(ranges: Iterable[tuple[int, int]], read: Callable[[int, int], object], *,
                 every_core: bool = False) -> str:
    """The digest of the state whose capsule stores arena ``ranges`` (``Layout.ranges(position)``).
    One core by default: the digest worker hashes every snapshot in the background, beside a
    decode that has the other cores. ``every_core``: for a request that waits on the hash (a
    fleet pull); a CPU decode running beside it shares the cores while it hashes."""
    return _hash(ranges, read, every_core)


def history_digest(regions: Iterable[_Region], position: int, read: Callable[[int, int], object]) -> str:
    spans = ((r.offset, r.offset + r.live_bytes(position)) for r in regions if r.name in HISTORY_REGIONS)
    return _hash(spans, read, False)
