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


def state_hasher(every_core: bool = False) -> blake3:
    """The hash whose digest of a capsule's bytes, fed to it in order, is its state digest: for
    a reader that hashes them as they arrive."""
    return blake3(max_threads=blake3.AUTO if every_core else 1)


def _hash(spans: Iterable[tuple[int, int]], read: Callable[[int, int], object], every_core: bool) -> str:
    """``read(start, end)`` returns the bytes at arena offsets [start, end): one buffer, or a
    list of buffers in order (hashed one after another, which is hashing them joined)."""
    h = state_hasher(every_core)
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


def state_and_span_digests(spans: Iterable[tuple[int, int]], read: Callable[[int, int], object]
                           ) -> tuple[str, tuple[str, ...]]:
    """(the state digest of ``spans``' bytes end to end, the digest of each span alone), on one
    core, reading each span once. With ``spans`` tiling ``Layout.ranges(position)`` in order,
    the first is ``state_digest``'s: the fleet tier names its chunks this way (``fleet_chunks``)."""
    whole = state_hasher()
    each = []
    for start, end in spans:
        part = blake3(max_threads=1)
        data = read(start, end) if end > start else []
        for buffer in data if isinstance(data, list) else (data,):
            whole.update(buffer)
            part.update(buffer)
        each.append(part.hexdigest())
    return whole.hexdigest(), tuple(each)


def history_digest(regions: Iterable[_Region], position: int, read: Callable[[int, int], object]) -> str:
    spans = ((r.offset, r.offset + r.live_bytes(position)) for r in regions if r.name in HISTORY_REGIONS)
    return _hash(spans, read, False)
