"""``x @ w`` for one float32 row on a CPU, by the small C kernel in ``src/row_product.c``.

A decode step multiplies one row by every weight matrix, so it streams the
weights from memory once and is bound by how fast a product reads them. Neither
torch's GEMV (one thread) nor a batched product over slabs of the weight (two
threads, the fallback in ``projection.project``) reads as fast as a plain
``sum`` over the same bytes: on the 2-core bench VM the slab products ran at
15-18 GB/s against 25-35 GB/s for the sum, which left the decode step at 2.3x
its bandwidth limit. Measured alone, the kernel reads within 10-15% of the
sum's speed (less inside a step, where the small operations between products
leave colder caches), and the bench model's decode step went from 15.1 to
11.9 ms (interleaved, 7 rounds).

Its sums do not depend on the thread count or the CPU (see the C file): a
journal recorded with it replays to the same bytes on any machine that has it.
It is built by colcon (CMakeLists.txt) and by ``pip install`` (setup.py), and
shares torch's OpenMP threads. Where it is not built, decode falls back to
the slab products, which round differently: engines record which one they use
(``Engine.decode_native``).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Callable

import torch

from .. import native

log = logging.getLogger(__name__)


def _load() -> tuple[Callable[..., None], int, ctypes.CDLL, int] | None:
    lib = native.library()
    if lib is None:
        return None
    try:
        fn, version = lib.flashrt_row_product, lib.flashrt_row_product_version()
    except AttributeError as exc:   # a library from another build of the package
        log.warning("the C library has no row-product kernel (%s): decode products fall back to torch", exc)
        return None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long, ctypes.c_long, ctypes.c_int]
    fn.restype = None
    return fn, lib.flashrt_row_product_slabs(), lib, version


_KERNEL = _load()


def available() -> bool:
    return _KERNEL is not None


def version() -> str:
    """What decides the kernel's bytes (its version and slab count), for journals; "" when not built."""
    return f"{_KERNEL[3]}.{_KERNEL[1]}" if _KERNEL is not None else ""


def use_portable_loop(on: bool) -> None:
    """Run the kernel's portable loop even where its AVX2/FMA one serves (on x86), or go back:
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
    if w.dim() != 2 or not w.is_contiguous() or partials.numel() < _KERNEL[1] * w.shape[1]:
        raise ValueError("row_product needs a contiguous 2-D weight and partials from scratch(n)")


def row_product(x: torch.Tensor, w: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
    """x [1, k] @ w [k, n], float32 on the CPU; w contiguous, ``partials`` from ``scratch(n)``."""
    check_weight(w, partials)
    return times_row(x, w, partials)


def times_row(x: torch.Tensor, w: torch.Tensor, partials: torch.Tensor) -> torch.Tensor:
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
    _KERNEL[0](x.data_ptr(), w.data_ptr(), y.data_ptr(), partials.data_ptr(), k, n, torch.get_num_threads())
    return y
