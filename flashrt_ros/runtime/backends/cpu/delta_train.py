"""The gated delta rule with its gradients, by the C kernel in ``src/delta_train.c``: for
training a small recurrent policy on a CPU.

transformers' chunked rule (``torch_chunk_gated_delta_rule``) is some forty torch operations
forward and as many backward per layer; at a policy's sizes (heads of 32, sequences of tens of
steps) each costs more to dispatch than to compute. The kernel runs the recurrence step by step
forward, keeping every state, and walks it back for the gradients, one sequence-head per thread.
It computes the same function in another order, so a policy trained with it rounds differently
from one trained without it; ``bench.training`` measures a training step both ways, side by side.

``rule`` takes transformers' arguments and is used in its place while training
(``replacing_transformers``).
"""
from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Iterator

import torch
from torch.autograd.function import once_differentiable

from ...gated_delta import l2_normalize
from . import library

_P, _L = ctypes.c_void_p, ctypes.c_long
_FORWARD = library.kernel("delta_train_forward", [_P] * 7 + [_L] * 4 + [ctypes.c_int], family="delta_train",
                          restype=ctypes.c_int)
_BACKWARD = library.kernel("delta_train_backward", [_P] * 12 + [_L] * 4 + [ctypes.c_int], family="delta_train",
                           restype=ctypes.c_int)
MAX_DIM = 256   # the C file's bound on a head's key and value widths
# transformers' arguments for several sequences packed into one row; the kernel runs one sequence a row.
_PACKING = ("cu_seqlens", "seq_idx")


def available() -> bool:
    return _FORWARD is not None and _BACKWARD is not None


def serves(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, initial_state: torch.Tensor | None = None,
           **packing: Any) -> bool:
    """Whether the kernel computes this call: float32 CPU tensors, a state that starts at zero,
    heads of at most ``MAX_DIM``, sequences not packed into one row (``cu_seqlens``, ``seq_idx``)."""
    return (available() and initial_state is None and all(packing.get(name) is None for name in _PACKING)
            and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (query, key, value))
            and key.shape[-1] <= MAX_DIM and value.shape[-1] <= MAX_DIM)


class _Rule(torch.autograd.Function):
    """q, k [n, t, dk]; v [n, t, dv]; g, beta [n, t], all contiguous float32 -> out [n, t, dv] and
    the final state [n, dk, dv] (which carries no gradient)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, t, dk = q.shape
        dv = v.shape[-1]
        library.check_float_tensors("delta_train", {"q": (q, (n, t, dk)), "k": (k, (n, t, dk)), "v": (v, (n, t, dv)),
                                                    "g": (g, (n, t)), "beta": (beta, (n, t))})
        out = torch.empty(n, t, dv)
        states = torch.empty(n, t + 1, dk, dv)
        code = _FORWARD[0](*map(torch.Tensor.data_ptr, (q, k, v, g, beta, out, states)), n, t, dk, dv,
                           torch.get_num_threads())
        if code:
            raise RuntimeError(f"delta_train_forward failed ({code}) on n={n}, t={t}, dk={dk}, dv={dv}")
        ctx.save_for_backward(q, k, v, g, beta, states)
        final = states[:, t].clone()   # not a view: a cache that keeps it must not keep every state
        ctx.mark_non_differentiable(final)
        return out, final

    @staticmethod
    @once_differentiable   # the kernel's gradients are not themselves differentiable: say so, not lose terms
    def backward(ctx: Any, dout: torch.Tensor, _final: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        q, k, v, g, beta, states = ctx.saved_tensors
        n, t, dk = q.shape
        dv = v.shape[-1]
        dout = dout.contiguous()
        grads = [torch.empty_like(x) for x in (q, k, v, g, beta)]
        code = _BACKWARD[0](*map(torch.Tensor.data_ptr, (q, k, v, g, beta, states, dout, *grads)), n, t, dk, dv,
                            torch.get_num_threads())
        if code:
            raise RuntimeError(f"delta_train_backward failed ({code}) on n={n}, t={t}, dk={dk}, dv={dv}")
        return tuple(grads)


def rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         initial_state: torch.Tensor | None = None, output_final_state: bool = False,
         use_qk_l2norm_in_kernel: bool = False, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' ``torch_chunk_gated_delta_rule`` computed by the kernel: query, key
    [batch, steps, key heads, dk], value [batch, steps, value heads, dv], g (log decay) and beta
    [batch, steps, value heads]; each key head serves consecutive value heads. Returns the output
    [batch, steps, value heads, dv] and, if asked, the final state [batch, value heads, dk, dv].
    Only calls ``serves`` accepts (a chunk size does not apply: the rule runs step by step)."""
    if not serves(query, key, value, initial_state, **kwargs):
        raise ValueError("delta_train.rule takes float32 CPU tensors, heads of at most "
                         f"{MAX_DIM}, no initial state and no packed sequences, with the kernel built")
    batch, steps, key_heads, dk = key.shape
    heads, dv = value.shape[-2:]
    query, key = (x.repeat_interleave(heads // key_heads, dim=2) for x in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = l2_normalize(query), l2_normalize(key)   # transformers' eps too
    query = query * dk ** -0.5

    def rows(x: torch.Tensor) -> torch.Tensor:   # [batch, steps, heads, ...] -> [batch * heads, steps, ...]
        return x.transpose(1, 2).reshape(batch * heads, steps, *x.shape[3:]).contiguous()

    out, final = _Rule.apply(*map(rows, (query, key, value, g.float(), beta.float())))
    out = out.reshape(batch, heads, steps, dv).transpose(1, 2).contiguous()
    return out, final.reshape(batch, heads, dk, dv) if output_final_state else None


@contextlib.contextmanager
def replacing_transformers() -> Iterator[bool]:
    """Within the block, transformers' Qwen3.5 linear-attention layers run ``rule`` for each call it
    serves (their own chunked rule for the rest). The module's function is swapped, so this holds
    for every thread of the process while the block lasts. Yields whether the kernel is built."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as modeling

    original = modeling.torch_chunk_gated_delta_rule
    if not available():
        yield False
        return

    def chosen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if serves(query, key, value, **kwargs):
            return rule(query, key, value, g, beta, **kwargs)
        return original(query, key, value, g=g, beta=beta, **kwargs)

    modeling.torch_chunk_gated_delta_rule = chosen
    try:
        yield True
    finally:
        modeling.torch_chunk_gated_delta_rule = original
