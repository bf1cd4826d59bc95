"""Decode's gated full-attention layer for one token on a CPU, by the C kernel in
``src/attention_step.c``.

Between its two projections an attention layer does some twenty small
operations per token (the q and k norms, RoPE, the K and V rows written at the
position, scores, softmax, the weighted values, the gate), and multiplying
the query by the cached keys copied them first (a permuted view). Measured
inside the bench model's decode steps, where the weights streamed between them
leave the caches cold, its two attention layers took 0.9 ms of a 10 ms step
outside their products. The kernel does them in one call, in float32, with every
sum in a fixed order (threads take whole KV heads); it reads the position from
the arena.

It rounds differently from the torch path (``attention.write_and_attend`` and
the layer around it), so it runs under the engine's ``decode_native`` option
with the other kernels, and journals record its version.
"""
from __future__ import annotations

import ctypes

import torch

from .. import native


class _Layer(ctypes.Structure):
    """``struct flashrt_attention_layer`` of the C file, field for field."""

    _fields_ = [("keys", ctypes.c_void_p), ("values", ctypes.c_void_p), ("row_stride", ctypes.c_long),
                ("rows", ctypes.c_long), ("position", ctypes.c_void_p), ("norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("scores", ctypes.c_void_p),
                ("qk", ctypes.c_void_p), ("heads", ctypes.c_int), ("kv_heads", ctypes.c_int),
                ("head_dim", ctypes.c_int), ("rotary", ctypes.c_int), ("eps", ctypes.c_float),
                ("scale", ctypes.c_float)]


_KERNEL = native.kernel("attention_step", [ctypes.POINTER(_Layer), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int],
                        restype=ctypes.c_int)


def available() -> bool:
    return _KERNEL is not None and _KV_ROWS is not None


def version() -> str:
    """What decides the kernel's bytes, for journals; "" when it is not built."""
    return _KERNEL[1] if _KERNEL is not None else ""


_KV_ROWS = native.kernel("kv_rows", [ctypes.POINTER(_Layer), ctypes.c_void_p], family="attention_step",
                         restype=ctypes.c_int)


def _bind(keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, norm: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, heads: int, eps: float) -> tuple[_Layer, tuple]:
    """The C struct of a layer, after checking every tensor it points into; and those tensors
    (with the scratch it needs), which must outlive it."""
    if _KERNEL is None or _KV_ROWS is None:
        raise RuntimeError("the attention-step kernel is not built (the package's C library is missing)")
    rows, kv_heads, head_dim = keys.shape
    rotary = cos.shape[1]
    for name, t in (("keys", keys), ("values", values)):   # cache rows strided, each row contiguous
        if t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (rows, kv_heads, head_dim) \
                or t.stride() != keys.stride() or t.stride()[1:] != (head_dim, 1):
            raise ValueError(f"attention step: {name} must be float32 CPU cache rows like the keys', got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    native.check_float_tensors("attention step", {
        "norm": (norm, (heads + kv_heads, head_dim)), "cos": (cos, (rows, rotary)), "sin": (sin, (rows, rotary))})
    if position.dtype != torch.int64 or position.device.type != "cpu" or position.numel() != 1:
        raise ValueError("attention step: position must be the arena's int64 CPU counter")
    if kv_heads < 1 or heads % kv_heads or rotary % 2 or rotary > head_dim:
        raise ValueError(f"attention step: {heads} query heads over {kv_heads} KV heads, rotary {rotary} of "
                         f"{head_dim}")
    scores = torch.empty(heads, rows, dtype=torch.float32)
    qk = torch.empty((heads + kv_heads) * head_dim, dtype=torch.float32)
    layer = _Layer(keys.data_ptr(), values.data_ptr(), keys.stride(0), rows, position.data_ptr(), norm.data_ptr(),
                   cos.data_ptr(), sin.data_ptr(), scores.data_ptr(), qk.data_ptr(), heads, kv_heads, head_dim,
                   rotary, eps, head_dim ** -0.5)
    return layer, (keys, values, position, norm, cos, sin, scores, qk)


class AttentionStep:
    """One layer, bound to its norms, the RoPE tables and its K and V caches (views into the
    arena, [rows, kv_heads, head_dim] each, written at the arena's position by each call)."""

    __slots__ = ("_layer", "_pointer", "_row", "_out", "_keep")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, *, heads: int, eps: float) -> None:
        self._layer, self._keep = _bind(keys, values, position, norm, cos, sin, heads, eps)
        self._pointer = ctypes.pointer(self._layer)
        head_dim, kv_heads = self._layer.head_dim, self._layer.kv_heads
        self._out = torch.empty(1, heads * head_dim, dtype=torch.float32)
        self._row = (2 * heads + 2 * kv_heads) * head_dim   # q | k | gate | v

    def __call__(self, row: torch.Tensor) -> torch.Tensor:
        """``row`` [1, q | k | gate | v] from the input projection; returns [1, heads * head_dim]
        for the output projection, in a buffer the next call reuses."""
        row = native.check_row("attention step", row, self._row)
        if _KERNEL[0](self._pointer, row.data_ptr(), self._out.data_ptr(), torch.get_num_threads()) != 0:
            _outside(self._layer)
        return self._out


class KVRows:
    """A layer whose K and V rows are kept, not attended over (the MTP layer's): its k norm,
    RoPE, and the rows written at the arena's position."""

    __slots__ = ("_layer", "_pointer", "_row", "_keep")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, k_norm: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, *, eps: float) -> None:
        self._layer, self._keep = _bind(keys, values, position, k_norm, cos, sin, 0, eps)
        self._pointer = ctypes.pointer(self._layer)
        self._row = 2 * self._layer.kv_heads * self._layer.head_dim   # k | v

    def __call__(self, row: torch.Tensor) -> None:
        row = native.check_row("kv rows", row, self._row)
        if _KV_ROWS[0](self._pointer, row.data_ptr()) != 0:
            _outside(self._layer)


def _outside(layer: _Layer) -> None:
    # The engine checks room before a step; this guards the caches' memory all the same.
    position = ctypes.cast(layer.position, ctypes.POINTER(ctypes.c_int64))[0]
    raise ValueError(f"attention step: position {position} is outside the caches' {layer.rows} rows")
