"""Decode steps as captured CUDA graphs, or the same callable run eagerly.

A step reads and writes only fixed addresses (the arena and static input and
output buffers), so one capture stays valid for the life of the engine:
restoring a capsule copies bytes into those addresses and replays continue.
"""
from __future__ import annotations

from typing import Callable

import torch


class Step:
    """A zero-argument step, replayed from a CUDA graph when captured."""

    def __init__(self, fn: Callable[[], None], capture: bool, warmup: int = 3) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        if capture:
            self._capture(warmup)

    def _capture(self, warmup: int) -> None:
        # Warm-up runs on a side stream, as graph capture requires; they change
        # state, so the engine captures before any state exists and zeroes after.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.fn()
        self.captures += 1

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()
