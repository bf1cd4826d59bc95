"""Page advice for large CPU buffers: ``populate`` maps a fresh buffer's pages in one call."""
from __future__ import annotations

import ctypes
import mmap
import sys

import pytest
import torch

from flashrt_ros.hugepages import populate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice is Linux's")


def _resident_pages(t: torch.Tensor) -> int:
    """How many of the pages under ``t`` are mapped now (``mincore``: these pages alone, not the
    process's, so nothing else this process does moves the count)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() & ~(mmap.PAGESIZE - 1)
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vector)


def test_populate_maps_a_fresh_buffers_pages_before_they_are_written():
    buffer = torch.empty(64 << 20, dtype=torch.uint8)   # past malloc's mmap threshold: fresh pages
    pages = (64 << 20) // mmap.PAGESIZE
    assert _resident_pages(buffer) < pages // 2
    if not populate(buffer):
        pytest.skip("this kernel cannot populate pages (MADV_POPULATE_WRITE needs Linux 5.14)")
    assert _resident_pages(buffer) >= pages
    buffer.fill_(7)
    assert int(buffer[0]) == int(buffer[-1]) == 7


def test_populate_leaves_what_it_cannot_map_as_it_is():
    assert populate(torch.empty(0, dtype=torch.uint8)) is False
    odd = torch.arange(1000, dtype=torch.int32)[1:]   # a start inside a page: rounded down, contents kept
    populate(odd)
    assert odd.tolist() == list(range(1, 1000))
