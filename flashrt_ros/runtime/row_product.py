"""``x @ w`` for one float32 row on a CPU, by the small C kernel in ``src/row_product.c``.

A decode step multiplies one row by every weight matrix, so it streams the
weights from memory once and is bound by how fast a product reads them. Neither
torch's GEMV (one thread) nor a batched product over slabs of the weight (two
threads, the fallback in ``projection.project``) reads as fast as a plain
``sum`` over the same bytes: on the 2-core bench VM the slab products ran at
15-18 GB/s against 25-35 GB/s for the sum, which left the decode step at 2.3x
its bandwidth limit. The kernel took the bench model's decode step from 15.1
to 11.9 ms (interleaved, 7 rounds). Weights that prefill never reads in their
row-major form (see ``Projection``) are kept in the kernel's tiled layout
(``tiled``), which it reads as one sequential stream: 35 against 28 GB/s over
the bench model's weights, where a plain sum read 38, the same bytes out, and
a step of 7.3-7.4 against 7.8-8.5 ms side by side.

Its sums do not depend on the thread count or the CPU (see the C file): a
journal recorded with it replays to the same bytes on any machine that has it.
It is built by colcon (CMakeLists.txt) and by ``pip install`` (setup.py), and
shares torch's OpenMP threads. Where it is not built, decode falls back to
the slab products, which round differently: engines record which one they use
(``Engine.decode_native``).
"""
from __future__ import annotations

import ctypes
from typing import Callable

import torch

from .. import native
from ..hugepages import empty_huge


def _load() -> tuple[Callable[..., int], int, ctypes.CDLL, str] | None:
    found = native.kernel("row_product", [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                                                   ctypes.c_int], restype=ctypes.c_int)
    lib = native.library()
    if found is None or not hasattr(lib, "flashrt_row_product_tile_rows"):   # not built, or an older build
        return None
    return found[0], lib.flashrt_row_product_slabs(), lib, found[1]


_KERNEL = _load()


def available() -> bool:
    return _KERNEL is not None


def version() -> str:
    """What decides the kernel's bytes (its version and slab count), for journals; "" when not built."""
    return f"{_KERNEL[3]}.{_KERNEL[1]}" if _KERNEL is not None else ""


def use_portable_loops(on: bool) -> None:
    """Run the kernel's portable loops even where its AVX2/FMA ones serve (on x86), or go back:
    to check that both give the same bytes."""
    _KERNEL[2].flashrt_row_product_portable(int(on))


def scratch(n: int) -> torch.Tensor:
    """The partial rows one product of output width ``n`` needs (kept by its caller: one
    allocation per weight, not per step)."""
    if _KERNEL is None:
        raise RuntimeError("the row-product kernel is not built")
    return torch.empty(_KERNEL[1] * n, dtype=torch.float32)


def check_weight(w: torch.Tensor, partials: torch.Tensor) -> None:
    """ValueError unless ``w`` and ``partials`` are what the kernel reads and writes: a wrong
    tensor would have it go past their memory. Once per weight (``Projection`` does it when
    built), not once per step."""
    for t in (w, partials):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"row_product takes float32 CPU tensors, got {t.dtype} on {t.device}")
    # partials contiguous too: an expanded tensor counts many elements over one float of memory.
    if w.dim() != 2 or not w.is_contiguous() or not partials.is_contiguous() \
            or partials.numel() < _KERNEL[1] * w.shape[1]:
        raise ValueError("row_product needs a contiguous 2-D weight and partials from scratch(n)")


def tiles_serve(k: int, n: int) -> bool:
    """Whether a [k, n] weight can take the tiled layout (see ``tiled``)."""
    if _KERNEL is None:
        return False
    rows, cols = _KERNEL[2].flashrt_row_product_tile_rows(), _KERNEL[2].flashrt_row_product_tile_columns()
    return k % (_KERNEL[1] * rows) == 0 and n % cols == 0


def tiled(w: torch.Tensor) -> torch.Tensor:
    """``w`` [k, n] in the kernel's tiled layout, same shape and bytes count: each block of
    R rows as tiles of R rows x C columns, one after the other (R, C from the C file). The
    kernel then streams a slab of it in one sequential pass instead of R side by side (28
    against 35 GB/s over the bench model's weights) and computes the same bytes."""
    k, n = w.shape
    if not tiles_serve(k, n):
        raise ValueError(f"a [{k}, {n}] weight cannot take the tiled layout")
    rows, cols = _KERNEL[2].flashrt_row_product_tile_rows(), _KERNEL[2].flashrt_row_product_tile_columns()
    blocks = w.reshape(k // rows, rows, n // cols, cols).permute(0, 2, 1, 3)
    return empty_huge((k, n), torch.float32, w.device).view(k // rows, n // cols, rows, cols).copy_(blocks).view(k, n)


def row_product(x: torch.Tensor, w: torch.Tensor, partials: torch.Tensor, is_tiled: bool = False) -> torch.Tensor:
    """x [1, k] @ w [k, n], float32 on the CPU; w contiguous (in the tiled layout when
    ``is_tiled``), ``partials`` from ``scratch(n)``."""
    check_weight(w, partials)
    if is_tiled and not tiles_serve(*w.shape):
        raise ValueError(f"a [{w.shape[0]}, {w.shape[1]}] weight cannot be in the tiled layout")
    return times_row(x, w, partials, is_tiled)


def times_row(x: torch.Tensor, w: torch.Tensor, partials: torch.Tensor, is_tiled: bool = False) -> torch.Tensor:
    """``row_product`` for a weight and partials already passed through ``check_weight``.

    The kernel runs without the interpreter lock (ctypes lets it go for the call), and
    writes ``partials``: two threads must not share one at once (the engine's lock keeps
    its steps apart).
    """
    k, n = w.shape
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"row_product takes float32 CPU tensors, got {x.dtype} on {x.device}")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != k:
        raise ValueError(f"row_product multiplies one row [1, {k}], got {tuple(x.shape)}")
    x = x.contiguous()
    y = torch.empty(1, n, dtype=torch.float32)
    if _KERNEL[0](x.data_ptr(), w.data_ptr(), y.data_ptr(), partials.data_ptr(), k, n, torch.get_num_threads(),
                  int(is_tiled)) != 0:
        raise ValueError(f"a [{k}, {n}] weight cannot be in the tiled layout")
    return y
