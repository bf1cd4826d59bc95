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

    def __init__(self, fn: Callable[[], None], capture: bool, warmup: int = 3,
                 device: torch.device | None = None, rewind: Callable[[], None] | None = None) -> None:
        """``device``: where to capture (the current CUDA device if None). ``rewind``: undoes
        what one run did to the position counter, so that warm-ups never reach past row 0."""
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captures = 0
        if capture:
            self._capture(warmup, device, rewind)

    def _capture(self, warmup: int, device: torch.device | None, rewind: Callable[[], None] | None) -> None:
        # Warm-up runs on a side stream, as graph capture requires; they change
        # state, so the engine captures before any state exists and zeroes after.
        # Streams are made on the engine's device: a capture's default stream is made once per
        # process, on whichever device was current then, and a graph of another device's
        # kernels would capture nothing.
        with torch.cuda.device(device):
            side = torch.cuda.Stream(device=device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(warmup):
                    self.fn()
                    if rewind is not None:
                        rewind()
            torch.cuda.current_stream(device).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            # thread_local: another engine's digest thread, reading a capsule meanwhile, must not
            # void this capture (global mode refuses such calls from any thread).
            with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(device=device),
                                  capture_error_mode="thread_local"):
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
