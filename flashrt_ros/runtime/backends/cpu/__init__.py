"""The CPU backend: the package's C library (``src/``), float32 only.

- ``row_product``: x @ W for up to ``MAX_ROWS`` rows (decode steps, verify rows), with a fixed
  summation order per row, so a row's bytes depend neither on the other rows, nor on the thread
  count, nor on the machine.
- ``delta_step``: the Gated DeltaNet mixer for one token or a prompt's tokens in one call (torch
  has no fused gated delta rule).

Where the library is not built, or off the CPU, the engine runs the torch reference path.
"""
from __future__ import annotations

import torch

from . import delta_step, row_product


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this backend can run an engine of ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype == torch.float32 and row_product.available() and delta_step.available()


KERNELS = ("row_product", "delta_step")


def versions() -> dict[str, str]:
    """What decides the backend's bytes, per kernel, for journals."""
    return dict(zip(KERNELS, (row_product.version(), delta_step.version())))
