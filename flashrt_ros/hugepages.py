"""Page advice for large CPU buffers (Linux ``madvise``): transparent huge pages, and pages
populated ahead of a fill.

Huge pages cost one TLB miss every 2 MiB of a buffer streamed through, against one every
4 KiB: for the arena and the capsule pools, made once and copied to and from on every
snapshot and restore. The advice only helps pages not yet touched, so callers allocate,
advise, then fill. For buffers made once, not on a request's path: with the kernel's default
defrag setting a huge page's first fault may stall while the kernel compacts memory, and in
a VM that hands freed memory back to its host a fresh huge page can cost more than its 512
small ones (the weights stay on small pages for that reason: ``runtime.models.cast``).
"""
from __future__ import annotations

import ctypes
import mmap
import sys

import torch

_HUGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_POPULATE_WRITE = 23   # Linux 5.14+; older kernels answer EINVAL, and the pages fault as they are written
_PAGE = mmap.PAGESIZE   # 4 KiB, or 16/64 KiB on some ARM kernels: madvise wants it aligned
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def empty_huge(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.empty``, advised to use huge pages when it is a large CPU buffer."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if _libc is not None and t.device.type == "cpu":
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first, last = (start + _HUGE - 1) & ~(_HUGE - 1), end & ~(_HUGE - 1)
        if last > first:  # failure only costs speed, never correctness
            _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_HUGEPAGE)
    return t


def populate(t: torch.Tensor) -> bool:
    """Map a fresh CPU buffer's pages now, in one call, rather than one fault per page as it
    is first written: a caller that fills a buffer on a request's path does this on a thread
    that would otherwise wait (a pull, while its first batch is on its way). True if the
    kernel mapped them; False elsewhere (another device or system, an older kernel), where
    the pages fault as they are written: failure only costs speed."""
    if _libc is None or t.device.type != "cpu" or t.numel() == 0:
        return False
    start = t.data_ptr() & ~(_PAGE - 1)
    end = t.data_ptr() + t.numel() * t.element_size()
    return _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_POPULATE_WRITE) == 0
