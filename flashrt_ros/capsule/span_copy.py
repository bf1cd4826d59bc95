"""Byte spans copied between CPU buffers in one C call (``src/copy_spans.c``).

A capsule's bytes are a few ranges of the arena (the fixed-size state, then
each per-token region's live rows). Copied through torch, every range needs a
view on each side and a dispatch: from a cold cache (a snapshot comes after a
decode step has streamed the weights through it) the views alone cost a third
of the copy of a 1.6 MiB state, and torch copying the arena's ranges into a
pool chunk took 209 us where a C call (then through ctypes) took 127-143 (a
copy between two plain buffers took the same time either way; bench VM,
interleaved). So spans are given by address. The C code writes long
stretches with non-temporal stores (see the C file): from a cold cache a
snapshot's copy then takes less than torch's copy of the same bytes.

It is a Python extension module, not a ctypes call like the package's other C
code: from a cold cache ctypes' conversions and the packed array it needs took
35-40 us more than this module's call (1.6 MiB copied in 95-123 us). Being
one, it can also run Python while the copy goes on (``during``): a snapshot's or
a restore's bookkeeping then takes the time of the other threads' first blocks. Without
the module, or on a GPU, callers copy through torch.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

try:
    from .. import _span_copy as _MODULE
except ImportError:   # not built (no C compiler at install): callers copy through torch
    _MODULE = None
if not hasattr(_MODULE, "copy_rows"):   # a stale build from before it: torch copies, not failed snapshots
    _MODULE = None


def available() -> bool:
    return _MODULE is not None


def address_of(t: torch.Tensor, nbytes: int = 0) -> int:
    """The address of a tensor whose bytes may be copied by span: 1-D, contiguous, uint8, on
    the CPU, and at least ``nbytes`` long (ValueError otherwise). Byte ``i`` of it is at
    ``address_of(t) + i``."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"spans are copied between 1-D contiguous uint8 CPU tensors, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    if t.numel() < nbytes:
        raise ValueError(f"spans reach byte {nbytes} of a tensor of {t.numel()} bytes")
    return t.data_ptr()


def copy(spans: Sequence[int]) -> None:
    """Copy flat (destination, source, length) triples, in one call.

    The caller vouches for the addresses: each span inside memory that stays alive
    for the call (addresses from ``address_of``, offsets checked against its size),
    no two overlapping. The copy lets go of the interpreter lock, as a torch copy does.
    """
    _MODULE.copy(spans, torch.get_num_threads())


def copy_rows(destination: int, source: int, fixed: int, rows: tuple[tuple[int, int], ...], start: int,
              end: int, during: Callable[[], T] | None = None) -> T | None:
    """``copy`` of bytes [0, fixed) of ``source``, then rows [start, end) of each (offset, row
    bytes) region of ``rows``, laid end to end at ``destination``: a capsule's ranges
    (``Layout.ranges``), with the spans built in C rather than in Python before the copy.

    ``during``: run on this thread while the others already copy (its result is returned, its
    exception raised, once every byte is copied). On this 2-core bench VM a capsule's
    bookkeeping so hid behind its copy: one thread alone copies nearly as fast as two.
    The caller vouches that nothing ``during`` does writes or frees the memory copied. It
    runs inside the copy's OpenMP region: torch's parallel loops run on one thread there,
    and the other threads wait at its end.
    """
    return _MODULE.copy_rows(destination, source, fixed, rows, start, end, torch.get_num_threads(), during)


class SpanCopy:
    """``copy`` prepared once and run by calling, for copies that repeat (a capsule's restore).
    ``keep``: what owns the memory the spans point into, held as long as this is."""

    __slots__ = ("_spans", "_keep")

    def __init__(self, spans: Sequence[int], keep: Sequence[object]) -> None:
        self._spans, self._keep = tuple(spans), list(keep)

    def __call__(self, during: Callable[[], T] | None = None) -> T | None:
        """``during`` as for ``copy_rows`` (a restore's bookkeeping)."""
        return _MODULE.copy(self._spans, torch.get_num_threads(), during)
