"""The Gated DeltaNet mixer on a CPU, by the C kernel in ``src/delta_step.c``: one token
(decode) or many (prefill).

Between its two projections a linear-attention layer does some forty small
operations per token: the causal conv and its state, SiLU, the L2 norms, the
gates, the delta-rule update of the recurrent state, the gated output norm. On
a CPU at decode sizes each costs more to dispatch than to compute. The
kernel does them in one call, in float32, with every sum in a fixed order
(``bench.runtime`` measures it against the torch layer side by side).

A prefill runs the rule token after token there too, not in the chunked form
(``gated_delta.chunked``): with a head's state in the L1 cache that is the
cheaper of the two on a CPU (see the C file), and a prompt's tokens then get
the same bytes as if decode had stepped them one by one.

It rounds differently from the torch operations (``gated_delta`` and the mixer
around it), so it runs with the rest of the CPU backend (the engine's ``cpu_kernels``
option), and journals record its version.
"""
from __future__ import annotations

import ctypes

import torch

from . import library


class _Layer(ctypes.Structure):
    """``struct flashrt_delta_layer`` of the C file, field for field."""

    _fields_ = [("conv_state", ctypes.c_void_p), ("conv_weight", ctypes.c_void_p), ("neg_a", ctypes.c_void_p),
                ("dt_bias", ctypes.c_void_p), ("state", ctypes.c_void_p), ("norm_weight", ctypes.c_void_p),
                ("conv_dim", ctypes.c_long), ("kernel", ctypes.c_int),
                ("key_heads", ctypes.c_int), ("value_heads", ctypes.c_int), ("key_dim", ctypes.c_int),
                ("value_dim", ctypes.c_int), ("q_scale", ctypes.c_float), ("k_scale", ctypes.c_float),
                ("qk_eps", ctypes.c_float), ("norm_eps", ctypes.c_float)]


_P, _L = ctypes.c_void_p, ctypes.c_long
# Named apart from version 1's one-token ``flashrt_delta_step`` (another signature and struct): a
# library left over from before is then not built as far as this module sees, not misread.
_KERNEL = library.kernel("delta_rows", [ctypes.POINTER(_Layer), _P, _L, _L, _P, _P, ctypes.c_int],
                        family="delta_step")
_PORTABLE = library.kernel("delta_portable", [ctypes.c_int], family="delta_step")


def use_portable_loops(on: bool) -> None:
    """Run the kernel's portable loops even where its AVX2/FMA ones serve (on x86), or go back:
    to check that both give the same bytes."""
    if _PORTABLE is None:
        raise RuntimeError("the delta-step kernel is not built")
    _PORTABLE[0](int(on))


def available() -> bool:
    return _KERNEL is not None


def version() -> str:
    """What decides the kernel's bytes, for journals; "" when it is not built."""
    return _KERNEL[1] if _KERNEL is not None else ""


class DeltaStep:
    """One layer's mixer, bound to its weights and to its conv and recurrent state (views into
    the arena, updated in place by each call)."""

    __slots__ = ("_layer", "_pointer", "_row_width", "_conv_width", "_out_width", "_mixed", "_out", "_keep")

    def __init__(self, conv_state: torch.Tensor, conv_weight: torch.Tensor, neg_a: torch.Tensor,
                 dt_bias: torch.Tensor, state: torch.Tensor, norm_weight: torch.Tensor, *,
                 key_heads: int, q_scale: float, k_scale: float, qk_eps: float, norm_eps: float) -> None:
        if _KERNEL is None:
            raise RuntimeError("the delta-step kernel is not built (the package's C library is missing)")
        value_heads, key_dim, value_dim = state.shape
        taps, conv_dim = conv_weight.shape
        library.check_float_tensors("delta step", {
            "conv_state": (conv_state, (taps - 1, conv_dim)), "conv_weight": (conv_weight, (taps, conv_dim)),
            "neg_a": (neg_a, (value_heads,)), "dt_bias": (dt_bias, (value_heads,)),
            "state": (state, (value_heads, key_dim, value_dim)), "norm_weight": (norm_weight, (value_dim,))})
        if min(key_heads, key_dim, value_heads, value_dim, taps) < 1 or value_heads % key_heads \
                or conv_dim != 2 * key_heads * key_dim + value_heads * value_dim:
            raise ValueError(f"delta step: {key_heads} key heads of {key_dim} and {value_heads} value heads of "
                             f"{value_dim} with {taps} conv taps do not make a conv of {conv_dim} channels")
        self._conv_width, self._out_width = conv_dim, value_heads * value_dim
        self._mixed = torch.empty(1, conv_dim, dtype=torch.float32)
        self._out = torch.empty(1, self._out_width, dtype=torch.float32)
        self._row_width = conv_dim + self._out_width + 2 * value_heads   # mixed | z | beta | a
        self._keep = (conv_state, conv_weight, neg_a, dt_bias, state, norm_weight)
        self._layer = _Layer(conv_state.data_ptr(), conv_weight.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
                             state.data_ptr(), norm_weight.data_ptr(), conv_dim, taps,
                             key_heads, value_heads, key_dim, value_dim, q_scale, k_scale, qk_eps, norm_eps)
        self._pointer = ctypes.pointer(self._layer)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` [n, conv + value + 2 heads] from the input projection, one per token in order;
        returns [n, value_heads * value_dim] for the output projection. One row (decode) runs on
        this thread into a buffer the next call reuses; more take torch's thread count."""
        rows = library.check_rows("delta step", rows, self._row_width)
        n = rows.shape[0]
        if n == 1:
            mixed, out, threads = self._mixed, self._out, 1
        else:
            mixed = torch.empty(n, self._conv_width, dtype=torch.float32)
            out = torch.empty(n, self._out_width, dtype=torch.float32)
            threads = torch.get_num_threads()
        _KERNEL[0](self._pointer, rows.data_ptr(), self._row_width, n, mixed.data_ptr(), out.data_ptr(), threads)
        return out
