"""The CPU backend: the package's C library (``src/``), float32 only.

- ``row_product``: x @ W for up to ``MAX_ROWS`` rows (decode steps, verify rows), with a fixed
  summation order per row, so a row's bytes depend neither on the other rows, nor on the thread
  count, nor on the machine.
- ``delta_step``: the Gated DeltaNet mixer for one token or a prompt's tokens in one call (torch
  has no fused gated delta rule).
- ``transpose_cast``: a checkpoint's matrix transposed and converted into the weights' layout
  at load, exactly (the bytes of torch's copies, so journals do not record it).
- ``delta_train``: the gated delta rule with its gradients, for training a policy (not used by
  the engine).

Where the library is not built, or off the CPU, the engine runs the torch reference path.
"""
from __future__ import annotations

import logging

import torch

from . import delta_step, row_product

log = logging.getLogger(__name__)


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this backend can run an engine of ``dtype`` on ``device``."""
    return device.type == "cpu" and dtype == torch.float32 and row_product.available() and delta_step.available()


def chosen(asked: bool, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an engine that ``asked`` for this backend runs on it. Where it would (float32 on
    a CPU) but the library is not built, a warning says how to build it."""
    serving = asked and serves(device, dtype)
    if asked and not serving and device.type == "cpu" and dtype == torch.float32:
        log.warning("the package's C library (src/) is not built: decode runs on the torch reference path; "
                    "build the package with a C compiler (colcon build, or pip install .)")
    return serving


KERNELS = ("row_product", "delta_step")


def versions() -> dict[str, str]:
    """What decides the backend's bytes, per kernel, for journals."""
    return dict(zip(KERNELS, (row_product.version(), delta_step.version())))
