"""Checkpoint weights onto the device, in the compute dtype and the runtime's layout: every
projection [in, out], fused along out.

On a CPU the weights go on the pages ``torch.empty`` gets (small ones unless the system's
transparent huge pages are set to ``always``), without asking for huge ones: a decode step
streams its weights from memory, where fewer TLB misses gain little, while a load faults in
gigabytes of fresh weights at once, and a fresh huge page can cost more than its small ones (in
a VM that hands freed memory back to its host). ``bench.released`` times both ways in one run
(``huge_pages``). The arena and the capsule pools, made once and copied to and from on every
snapshot and restore, ask for huge pages.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from ...hugepages import empty_huge
from ..backends.cpu import transpose_cast
from ..projection import Projection

_STRIPED = 1 << 22        # elements: a matrix at least this large is transposed in stripes (``_turn``)
_STRIPE_BYTES = 2 << 20   # one stripe of the stored matrix: enough stripes to keep every thread busy
_switch = threading.Lock()
_huge = 0   # how many ``huge_pages`` blocks are open, in any thread


@contextlib.contextmanager
def huge_pages() -> Iterator[None]:
    """Weights built meanwhile, in any thread, go on transparent huge pages: for the benchmark
    that loads and decodes both ways. Blocks may nest."""
    global _huge
    with _switch:
        _huge += 1
    try:
        yield
    finally:
        with _switch:
            _huge -= 1


class Cast:
    """Weights onto the device, in the compute dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype

    def empty(self, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """An uninitialised weight buffer on the device, in the compute dtype."""
        if _huge:
            return empty_huge(shape, self.dtype, self.device)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.empty(t.shape).copy_(t.detach())

    def t(self, *parts: torch.Tensor) -> torch.Tensor:
        """Fuse [out, in] matrices along out and store the result as [in, out]. On a device,
        the device transposes. On a CPU in float32, the package's kernel writes each part into
        its columns in one pass (``backends.cpu.transpose_cast``); otherwise each part is
        transposed in its stored dtype first and cast after, each copy one that torch runs at
        memory speed (a transposing copy that also converts runs element by element). Torch's
        transpose of a contiguous matrix is one thread's blocked loop, so a large one is then
        cut into stripes of rows transposed on ``torch.get_num_threads()`` threads, while this
        thread casts each transposed stripe into its columns of the result with torch's own
        threads (the same copies, the same bytes; one team of torch threads at a time)."""
        parts = tuple(p.detach() for p in parts)
        if any(p.dim() != 2 or p.shape[1] != parts[0].shape[1] for p in parts):
            raise ValueError(f"fused parts must be matrices of one input width, got {[tuple(p.shape) for p in parts]}")
        out = self.empty((parts[0].shape[1], sum(p.shape[0] for p in parts)))
        if self.device.type != "cpu":
            # The stored matrix crosses as it is (one contiguous copy); the device transposes
            # and casts it, not one host thread.
            whole = parts[0] if len(parts) == 1 else torch.cat(parts)
            return out.copy_(whole.to(self.device).t())
        first = 0
        for part in parts:
            _turn(part, out, first)
            first += part.shape[0]
        return out

    def t_each(self, stack: torch.Tensor) -> torch.Tensor:
        """Each [out, in] matrix of a stack [n, out, in] (an MoE layer's experts) as [in, out],
        the way ``t`` stores one."""
        stack = stack.detach()
        out = self.empty((stack.shape[0], stack.shape[2], stack.shape[1]))
        if self.device.type != "cpu":
            return out.copy_(stack.to(self.device).transpose(1, 2))
        for matrix, turned in zip(stack, out):
            _turn(matrix, turned, 0)
        return out

    def proj(self, *parts: torch.Tensor) -> Projection:
        return Projection(self.t(*parts))

    def one_plus(self, w: torch.Tensor) -> torch.Tensor:
        return (1.0 + w.detach().float()).to(self.device)


def _turn(part: torch.Tensor, out: torch.Tensor, first: int) -> None:
    """``out[:, first:first + rows] = part.t()`` in ``out``'s dtype, on a CPU (see ``Cast.t``)."""
    if transpose_cast.serves(part, out):
        transpose_cast.into(part, out, first)
        return
    out = out[:, first:first + part.shape[0]]
    if part.dtype == out.dtype:
        out.copy_(part.t())
        return
    threads = torch.get_num_threads()
    if threads < 2 or part.numel() < _STRIPED:
        out.copy_(part.t().contiguous())
        return
    rows = max(1, _STRIPE_BYTES // (part.shape[1] * part.element_size()))
    tops = range(0, part.shape[0], rows)
    with ThreadPoolExecutor(threads) as pool:
        stripes = pool.map(lambda top: part[top:top + rows].t().contiguous(), tops)
        for top, stripe in zip(tops, stripes):
            out[:, top:top + rows].copy_(stripe)
