"""Page advice for large CPU buffers: ``populate`` maps a fresh buffer's pages in one call."""
from __future__ import annotations

import mmap
import sys

import pytest
import torch

from flashrt_ros.hugepages import populate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise advice is Linux's")


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * mmap.PAGESIZE


def test_populate_maps_a_fresh_buffers_pages_before_they_are_written():
    buffer = torch.empty(64 << 20, dtype=torch.uint8)   # past malloc's mmap threshold: fresh pages
    before = _resident_bytes()
    if not populate(buffer):
        pytest.skip("this kernel cannot populate pages (MADV_POPULATE_WRITE needs Linux 5.14)")
    assert _resident_bytes() - before >= 0.9 * buffer.numel()
    buffer.fill_(7)
    assert int(buffer[0]) == int(buffer[-1]) == 7


def test_populate_leaves_what_it_cannot_map_as_it_is():
    assert populate(torch.empty(0, dtype=torch.uint8)) is False
    odd = torch.arange(1000, dtype=torch.int32)[1:]   # a start inside a page: rounded down, contents kept
    populate(odd)
    assert odd.tolist() == list(range(1, 1000))
