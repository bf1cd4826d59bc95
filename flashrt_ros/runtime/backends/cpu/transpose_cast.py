"""A checkpoint's [out, in] matrix into columns of a float32 [in, out] weight, by the C kernel in
``src/transpose_cast.c``: the bulk of a CPU load.

A released checkpoint is bfloat16 and every projection is stored [out, in]; the runtime keeps
its weights float32 and [in, out] (``runtime.projection``). Torch turns a matrix with a copy
that, when it also converts, runs element by element, and its transposing copy of one dtype
runs on one thread; the kernel does both in one pass over cache-sized tiles on every thread
(``bench.released`` section 1 loads with and without it, side by side). Both conversions are
exact, so the weights are the same bytes either way; where the library is not built, or for
another dtype, the caller uses torch's copies.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch

from . import library

_FOUND = library.kernel("transpose_cast", [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_long] * 3
                        + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int], restype=ctypes.c_int)
_SOURCES = (torch.float32, torch.bfloat16)
_off = False


def serves(source: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel can write ``source`` [rows, cols] into ``out``: float32 or bfloat16
    into float32, both on the CPU, the library built (and not switched off by ``disabled``)."""
    return (_FOUND is not None and not _off and source.dtype in _SOURCES and out.dtype == torch.float32
            and source.device.type == "cpu" and out.device.type == "cpu")


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Callers use torch's copies meanwhile: for the benchmark that loads both ways."""
    global _off
    _off = True
    try:
        yield
    finally:
        _off = False


def into(source: torch.Tensor, out: torch.Tensor, first: int) -> None:
    """``out[:, first:first + rows] = source.t()`` converted to float32, where ``serves``.
    ValueError when the shapes do not fit: the kernel writes by address."""
    if source.dim() != 2 or out.dim() != 2 or not out.is_contiguous():
        raise ValueError("transpose_cast takes a 2-D source and a contiguous 2-D float32 destination")
    rows, cols = source.shape
    if cols != out.shape[0] or not 0 <= first <= out.shape[1] - rows:
        raise ValueError(f"a [{rows}, {cols}] matrix does not fit columns {first}.. of a {tuple(out.shape)} weight")
    if rows == 0 or cols == 0:
        return
    if source.stride(1) != 1 or source.stride(0) < cols:
        source = source.contiguous()
    # ctypes lets the interpreter lock go for the call; the kernel shares torch's OpenMP threads.
    done = _FOUND[0](source.data_ptr(), int(source.dtype == torch.bfloat16), rows, cols, source.stride(0),
                     out.data_ptr() + first * out.element_size(), out.shape[1], torch.get_num_threads())
    if done != 0:
        raise ValueError(f"transpose_cast refused a [{rows}, {cols}] matrix of stride {source.stride(0)}")
