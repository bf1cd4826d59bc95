"""A checkpoint's [out, in] matrix into columns of a float32 [in, out] weight, by the C kernel in
``src/transpose_cast.c``: what a CPU load writes its weights with.

A released checkpoint is bfloat16 and every projection is stored [out, in]; the runtime keeps
its weights float32 and [in, out] (``runtime.projection``). The kernel transposes and converts
in one pass over cache-sized tiles on torch's threads; torch's copies reach the same result in
two (a transposing copy that also converts goes element by element). Both conversions are exact,
so the weights are the same bytes either way: where the library is not built, or for another
dtype, the caller uses torch's copies. It runs whenever it is built, whatever the engine's
``cpu_kernels`` (which chooses how the model computes, not how its weights are laid out).
``bench.released`` section 1 loads both ways side by side.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator

import torch

from . import library

_FOUND = library.kernel("transpose_cast", [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_long] * 3
                        + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int], restype=ctypes.c_int)
_SOURCES = (torch.float32, torch.bfloat16)
_switch = threading.Lock()
_off = 0   # how many ``disabled`` blocks are open, in any thread


def serves(source: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel can write ``source`` into ``out``: float32 or bfloat16 into float32,
    plain strided CPU tensors, the library built (and not switched off by ``disabled``)."""
    return _FOUND is not None and not _off and _plain(source, _SOURCES) and _plain(out, (torch.float32,))


def _plain(t: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """A CPU tensor of one of ``dtypes`` whose elements are its memory as it reads (no lazy
    negation or conjugation for the kernel to miss)."""
    return (t.dtype in dtypes and t.device.type == "cpu" and t.layout == torch.strided
            and not t.is_neg() and not t.is_conj())


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Callers use torch's copies meanwhile, in every thread: for the benchmark that loads both
    ways and the tests that compare them. Blocks may nest."""
    global _off
    with _switch:
        _off += 1
    try:
        yield
    finally:
        with _switch:
            _off -= 1


def into(source: torch.Tensor, out: torch.Tensor, first: int) -> None:
    """``out[:, first:first + rows] = source.t()`` converted to float32. ValueError, before
    anything is written, unless ``serves`` holds and the shapes fit without the two sharing
    memory: the kernel writes by address."""
    if _FOUND is None or not _plain(source, _SOURCES) or not _plain(out, (torch.float32,)):
        raise ValueError(f"transpose_cast takes a float32 or bfloat16 CPU source and a float32 CPU destination, "
                         f"got {source.dtype} on {source.device} and {out.dtype} on {out.device}"
                         + ("" if _FOUND is not None else " (and the library is not built)"))
    if source.dim() != 2 or out.dim() != 2 or not out.is_contiguous():
        raise ValueError("transpose_cast takes a 2-D source and a contiguous 2-D float32 destination")
    rows, cols = source.shape
    if cols != out.shape[0] or not 0 <= first <= out.shape[1] - rows:
        raise ValueError(f"a [{rows}, {cols}] matrix does not fit columns {first}.. of a {tuple(out.shape)} weight")
    if rows == 0 or cols == 0:
        return
    if source.stride(1) != 1 or (rows > 1 and source.stride(0) < cols):
        source = source.contiguous()
    stride = source.stride(0) if rows > 1 else cols   # one row: its stride is never used
    if _overlap(source, (rows - 1) * stride + cols, out, out.numel()):
        raise ValueError("transpose_cast refuses a source that shares memory with its destination")
    # ctypes lets the interpreter lock go for the call; the kernel shares torch's OpenMP threads.
    done = _FOUND[0](source.data_ptr(), int(source.dtype == torch.bfloat16), rows, cols, stride,
                     out.data_ptr() + first * out.element_size(), out.shape[1], torch.get_num_threads())
    if done != 0:
        raise ValueError(f"transpose_cast refused a [{rows}, {cols}] matrix of stride {stride}")


def _overlap(a: torch.Tensor, a_elements: int, b: torch.Tensor, b_elements: int) -> bool:
    """Whether the byte spans the kernel reads of ``a`` and writes of ``b`` meet."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b_elements * b.element_size() and b0 < a0 + a_elements * a.element_size()
