"""Where capsule bytes live in memory: the device pool and host buffers.

The device tier is ONE buffer allocated when the engine starts; snapshots
carve chunks out of it with a first-fit free list, so the snapshot path
never calls the allocator. Host chunks are separate buffers, pinned when
CUDA is present so that copies to and from the device are DMA transfers.
"""
from __future__ import annotations

import bisect

import torch

from ..hugepages import empty_huge
from .errors import InvalidCapsuleRequest

_ALIGN = 256


class Chunk:
    """An immutable run of bytes shared by the capsules that reference it: bytes
    [offset, offset + nbytes) of a buffer (a pool chunk), or all of one (``Chunk.holding``)."""

    __slots__ = ("tier", "data", "nbytes", "offset", "refs", "landed", "_array")

    def __init__(self, tier: str, whole: torch.Tensor, offset: int, nbytes: int) -> None:
        self.tier, self.offset, self.nbytes, self.refs = tier, offset, nbytes, 0
        self.data = whole[offset:offset + nbytes]
        self.landed = self._array = None   # landed: a CUDA event after copies from the GPU

    @classmethod
    def holding(cls, tier: str, data: torch.Tensor) -> "Chunk":
        """A chunk that is all of ``data``."""
        return cls(tier, data, 0, data.numel())

    def copied_from(self, device: torch.device) -> None:
        """Mark the copies just queued from ``device`` into this (host) chunk: CPU reads wait for them."""
        if device.type == "cuda":
            self.landed = torch.cuda.Event()
            self.landed.record(torch.cuda.current_stream(device))

    def wait(self) -> None:
        """Return once the bytes are in place for the CPU to read (at once on a CPU)."""
        landed = self.landed
        if landed is not None:
            landed.synchronize()

    def readable(self, offset: int, nbytes: int):
        """Bytes [offset, offset + nbytes) for the CPU to read, as a NumPy array: a view on a
        CPU chunk, a copy from a GPU one."""
        self.wait()
        if self.data.device.type != "cpu":
            return self.data[offset:offset + nbytes].cpu().numpy()
        if self._array is None:
            self._array = self.data.numpy()
        return self._array[offset:offset + nbytes]


class DevicePool:
    """A fixed buffer with first-fit allocation; ``allocate`` returns None when nothing fits."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        """InvalidCapsuleRequest if ``device`` has no room for ``nbytes``."""
        self.nbytes = nbytes
        try:
            # Huge pages on a CPU, as the arena has: snapshot and restore stream between the two.
            self.buffer = empty_huge((nbytes,), torch.uint8, device)
        except (RuntimeError, MemoryError) as exc:   # torch's out-of-memory errors are RuntimeErrors
            raise InvalidCapsuleRequest(f"the device budget of {nbytes} bytes cannot be allocated on {device}: "
                                        f"{str(exc).splitlines()[0][:200]}") from None
        self._free: list[tuple[int, int]] = [(0, nbytes)] if nbytes else []   # sorted (offset, size)

    @staticmethod
    def footprint(nbytes: int) -> int:
        """The pool bytes a chunk of ``nbytes`` takes (chunks start aligned)."""
        # Rounded up to the alignment, one unit at the least.
        return max(_ALIGN, (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN)

    def _first_fit(self, size: int) -> int | None:
        """Index of the first free run that holds ``size`` bytes."""
        for i, (_, free) in enumerate(self._free):
            if free >= size:
                return i
        return None

    def allocate(self, nbytes: int) -> Chunk | None:
        size = self.footprint(nbytes)
        i = self._first_fit(size)
        if i is None:
            return None
        offset, free = self._free[i]
        # Made before the free list changes: a Ctrl-C raised as the call into Chunk begins loses no space.
        chunk = Chunk("device", self.buffer, offset, nbytes)
        if free == size:
            del self._free[i]
        else:
            self._free[i] = (offset + size, free - size)
        return chunk

    def release(self, chunk: Chunk) -> None:
        size = self.footprint(chunk.nbytes)
        i = bisect.bisect(self._free, (chunk.offset, size))
        self._free.insert(i, (chunk.offset, size))
        # Merge with the right, then the left neighbour, so free space stays in few runs.
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free.pop(i)[1])

    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def largest_free_after(self, chunks: list[Chunk]) -> int:
        """The largest free run if ``chunks`` were released (nothing is released)."""
        runs = sorted(self._free + [(c.offset, self.footprint(c.nbytes)) for c in chunks])
        largest, start, end = 0, None, None
        for offset, size in runs:
            if start is not None and offset == end:
                end += size
            else:
                start, end = offset, offset + size
            largest = max(largest, end - start)
        return largest


def host_chunk(nbytes: int, pin: bool) -> Chunk:
    return Chunk.holding("host", torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin))
