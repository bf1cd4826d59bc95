"""``x @ w`` for a few float32 rows on a CPU, by the C kernel in ``src/row_product.c``.

A decode step multiplies one row by every weight matrix, so it streams the weights from memory
once and is bound by how fast a product reads them; torch runs a one-row product (a GEMV) on one
thread, and the kernel reads the same bytes with every thread (``bench.runtime`` measures the two
side by side). Verify rows of speculative decoding multiply up to ``MAX_ROWS`` rows in the same
one pass over the weights, each row with the same summation order it has alone: the rows come
out bit for bit as single-row steps would make them.

Its sums depend neither on the thread count nor on the CPU (see the C file). It shares torch's
OpenMP threads.
"""
from __future__ import annotations

import ctypes

import torch

from . import library

_FOUND = library.kernel("row_product", [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_int],
                        restype=ctypes.c_int)
# Names of version 1 (a one-row kernel with a tiled layout) are not this module's kernel.
if _FOUND is not None and not hasattr(library.library(), "flashrt_row_product_max_rows"):
    _FOUND = None
_LIB = library.library() if _FOUND is not None else None
SLABS = _LIB.flashrt_row_product_slabs() if _LIB is not None else 0
MAX_ROWS = _LIB.flashrt_row_product_max_rows() if _LIB is not None else 0


def available() -> bool:
    return _FOUND is not None


def version() -> str:
    """What decides the kernel's bytes (its version and slab count), for journals; "" when not built."""
    return f"{_FOUND[1]}.{SLABS}" if _FOUND is not None else ""


def use_portable_loops(on: bool) -> None:
    """Run the kernel's portable loops even where its AVX2/FMA ones serve (on x86), or go back:
    to check that both give the same bytes."""
    _LIB.flashrt_row_product_portable(int(on))


def scratch(n: int) -> torch.Tensor:
    """The partial rows that products of output width up to ``n`` need, for up to MAX_ROWS rows:
    made once and shared by every projection of an engine (its lock keeps products apart)."""
    if _FOUND is None:
        raise RuntimeError("the row-product kernel is not built")
    return torch.empty(SLABS * MAX_ROWS * n, dtype=torch.float32)


def check_weight(w: torch.Tensor, partials: torch.Tensor) -> None:
    """ValueError unless ``w`` and ``partials`` are what the kernel reads and writes: a wrong
    tensor would have it go past their memory. Once per weight, not once per step."""
    for t in (w, partials):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"row_product takes float32 CPU tensors, got {t.dtype} on {t.device}")
    # partials contiguous too: an expanded tensor counts many elements over one float of memory.
    if w.dim() != 2 or not w.is_contiguous() or not partials.is_contiguous() \
            or partials.numel() < SLABS * MAX_ROWS * w.shape[1]:
        raise ValueError("row_product needs a contiguous 2-D weight and partials from scratch(n) of its width")


def row_product(x: torch.Tensor, w: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ w [k, n], float32 on the CPU, 1 <= m <= MAX_ROWS; ``partials`` from ``scratch``."""
    check_weight(w, partials)
    return times_rows(x, w, partials)


def times_rows(x: torch.Tensor, w: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    """``row_product`` for a weight and partials already passed through ``check_weight``.

    The kernel runs without the interpreter lock (ctypes lets it go for the call), and writes
    ``partials``: two threads must not share them at once (the engine's lock keeps steps apart).
    """
    k, n = w.shape
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"row_product takes float32 CPU tensors, got {x.dtype} on {x.device}")
    if x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != k:
        raise ValueError(f"row_product multiplies 1 to {MAX_ROWS} rows of {k}, got {tuple(x.shape)}")
    x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _FOUND[0](x.data_ptr(), w.data_ptr(), y.data_ptr(), partials.data_ptr(), m, k, n, torch.get_num_threads())
    return y
