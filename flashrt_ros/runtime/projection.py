"""The model's matrix products: ``x @ w`` with each weight kept in the layout its rows want.

Decode multiplies one row, and on a CPU that streams the weight from memory:
[in, out] row-major is the layout for it, multiplied by the C kernel of
``row_product`` where it is built (float32), else by slabs (see ``project``).
Prefill multiplies hundreds of rows, and there oneDNN's blocked layout runs
1.3-1.6x the GFLOP/s of ``torch.mm`` on the bench model's shapes (2-core
AVX-512 VM, fp32, measured side by side). A ``Projection`` keeps both where
oneDNN serves (fp32 on an x86 CPU, weights of 512 KiB and more): twice the
memory of those weights, for the prefill speed. A row's product on the blocked
weights comes out the same bytes whatever rows are multiplied with it, whatever
the thread count and whatever row count the layout was made for (checked on
the bench VM; a test keeps the first two).
"""
from __future__ import annotations

import os
import platform

import torch

from . import row_product

# The row count oneDNN is told to expect when it lays a weight out; the products
# come out the same for any other count (see above), only a little slower.
_ROWS_HINT = 512
# Below this many weights (512 KiB in fp32) oneDNN's call costs more than its layout
# saves: with the embedded default's 128-wide projections blocked, a 4000-token prefill
# took the same time as on torch.mm, and three short prompts (23-61 tokens) 16.9
# against 14.4 ms (interleaved, 9 rounds).
_MIN_BLOCKED = 1 << 17


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for x [n, in] and w [in, out].

    One fp32 row on a CPU is a GEMV, which torch runs on one thread: 23 GB/s
    on the 2-core bench machine, where two threads read 36 GB/s. So ``w`` is cut
    along ``in`` into slabs (a free view of the same memory), one batched product
    spreads the slabs over the threads, and their partial rows are summed: one
    decode step's 180 MB of weights took 6.6 instead of 10.5 ms. The slab count
    is fixed, not the thread count, so the numbers do not depend on the machine.
    """
    n, k = x.shape
    if n == 1 and x.device.type == "cpu" and w.dtype == torch.float32:
        slabs = next((s for s in _SLABS if k % s == 0), 1)
        if slabs > 1:
            return torch.bmm(x.reshape(slabs, 1, k // slabs), w.view(slabs, k // slabs, -1)).sum(0)
    return x @ w


_SLABS = (8, 4, 2)


# torch's x86 kernel level (ATEN_CPU_CAPABILITY) -> the same cap for oneDNN, which picks its own.
ONEDNN_ENV = "ONEDNN_MAX_CPU_ISA"
ONEDNN_CAP = {"default": "SSE41", "avx2": "AVX2"}


def cap_onednn_like_torch() -> None:
    """A process that holds torch to AVX2 kernels (to record a journal any x86 machine can
    replay) holds oneDNN there too; blocked products round differently at AVX-512. oneDNN
    reads the variable once, at its first use, so this must come before the first blocked
    weight is made."""
    cap = ONEDNN_CAP.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower())
    if cap is not None and ONEDNN_ENV not in os.environ and "DNNL_MAX_CPU_ISA" not in os.environ:
        os.environ[ONEDNN_ENV] = cap


def blocked_layout_serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether prefill products can use a oneDNN blocked copy of the weights here.
    x86 only: oneDNN on ARM goes through other kernels, not measured."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and platform.machine().lower() in ("x86_64", "amd64"))


def native_rows_serve(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether one-row products can run on the C kernel here (see ``row_product``)."""
    return device.type == "cpu" and dtype == torch.float32 and row_product.available()


class Projection:
    """``x @ w`` for w [in, out]; many-row inputs go through ``blocked`` when there is one,
    one-row inputs through the C kernel when ``partials`` is set (``native_rows``).

    Where many-row products never read ``w`` (they go through the blocked copy, or, with
    ``many_rows`` False, there are none), the kernel's own tiled layout replaces it
    (``tiled``; see ``row_product.tiled``): no second copy of the weight."""

    __slots__ = ("w", "blocked", "partials", "tiled")

    def __init__(self, w: torch.Tensor, blocked: bool = False, native_rows: bool = False,
                 many_rows: bool = True) -> None:
        # oneDNN takes the weight as [out, in] and returns its own (opaque) tensor.
        self.blocked = (torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), _ROWS_HINT)
                        if blocked and w.numel() >= _MIN_BLOCKED else None)
        self.partials = row_product.scratch(w.shape[1]) if native_rows else None
        self.tiled = (self.partials is not None and (self.blocked is not None or not many_rows)
                      and row_product.tiles_serve(*w.shape))
        self.w = row_product.tiled(w) if self.tiled else w
        if self.partials is not None:
            row_product.check_weight(self.w, self.partials)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and self.partials is not None:
            return row_product.times_row(x, self.w, self.partials, self.tiled)
        if self.blocked is not None and x.shape[0] > 1:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.blocked, None, "none", [], "")
        if self.tiled and x.shape[0]:   # only a projection built with many_rows=False gets here
            raise ValueError("this projection multiplies one row at a time (built with many_rows=False)")
        return project(x, self.w)
