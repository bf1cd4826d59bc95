"""The small operations between a decode step's products, for one float32 row on a CPU, by the
C kernels in ``src/row_ops.c``: RMS norms, a residual add fused with the norm after it, and
SwiGLU's SiLU(gate) * up.

In torch each is several operations (an RMS norm is five), and inside a decode step, where
the weights streamed between them leave the caches cold, the eight blocks' norms, residuals
and activations took 0.9 ms of the bench model's 10 ms step. They round differently from the
torch operations, so they run under the engine's ``decode_native`` option with the other
kernels, and journals record their version.
"""
from __future__ import annotations

import ctypes

import torch

from .. import native

_P, _F, _L = ctypes.c_void_p, ctypes.c_float, ctypes.c_long
_NORM = native.kernel("rms_norm", [_P, _P, _F, _L, _P], family="row_ops")
_ADD_NORM = native.kernel("add_rms_norm", [_P, _P, _P, _F, _L, _P, _P], family="row_ops")
_SILU_MUL = native.kernel("silu_mul", [_P, _L, _P], family="row_ops")


def available() -> bool:
    return None not in (_NORM, _ADD_NORM, _SILU_MUL)


def version() -> str:
    """What decides the kernels' bytes, for journals; "" when they are not built."""
    return _NORM[1] if available() else ""


def check_scale(scale: torch.Tensor, width: int) -> None:
    """ValueError unless ``scale`` is a norm's float32 CPU weight for rows of ``width``: once,
    when a model binds it, not per call."""
    native.check_float_tensors("row norm", {"scale": (scale, (width,))})


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``layers.rms_norm`` of one row [1, n]; ``scale`` passed through ``check_scale``. Into
    ``out`` (a contiguous float32 row [1, n]) when given."""
    n = scale.shape[0]
    x = native.check_row("row norm", x, n)
    if out is None:
        out = torch.empty(1, n, dtype=torch.float32)
    elif native.check_row("row norm output", out, n) is not out:   # a copy would take the result
        raise ValueError("row norm output must be contiguous")
    _NORM[0](x.data_ptr(), scale.data_ptr(), eps, n, out.data_ptr())
    return out


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, scale: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                                           torch.Tensor]:
    """(x + h, rms_norm(x + h)) for rows [1, n]."""
    n = scale.shape[0]
    x, h = native.check_row("row norm", x, n), native.check_row("row norm", h, n)
    total, normed = torch.empty(1, n, dtype=torch.float32), torch.empty(1, n, dtype=torch.float32)
    _ADD_NORM[0](x.data_ptr(), h.data_ptr(), scale.data_ptr(), eps, n, total.data_ptr(), normed.data_ptr())
    return total, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a row [1, 2n] = [gate | up]; returns [1, n]."""
    n = gate_up.shape[-1] // 2
    gate_up = native.check_row("silu_mul", gate_up, 2 * n)
    out = torch.empty(1, n, dtype=torch.float32)
    _SILU_MUL[0](gate_up.data_ptr(), n, out.data_ptr())
    return out
