"""Run a callable under several torch thread counts (the native kernels split work by them)."""
from __future__ import annotations

from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def at_thread_counts(run: Callable[[], T], counts: tuple[int, ...] = (1, 2, 3)) -> list[T]:
    """``run()`` once per count, in order; torch's thread count is put back afterwards."""
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in counts:
            torch.set_num_threads(count)
            outs.append(run())
        return outs
    finally:
        torch.set_num_threads(threads)
