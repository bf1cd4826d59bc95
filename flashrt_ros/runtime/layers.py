"""Small functional pieces shared by the hybrid decoder: norms, RoPE and the MLP.

Everything here is a pure function of its tensors, so that the eager path and
the captured CUDA graph run literally the same code.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .projection import Projection


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, multiplied by ``scale`` before the cast back, as Qwen3.5 does.

    ``scale`` is fp32 and already ``1 + w``: the checkpoint stores these norm
    weights as offsets from one, and the model adds the one once at load. It
    may have a row per head. A decode step runs dozens of norms of one row, where
    the cost is dispatches: ``mean`` and a Python-number ``add_`` each wrap a
    scalar in a tensor (``torch.rms_norm`` does the same inside), so the mean and
    eps go in as one ``add`` onto a cached eps tensor, one dispatch fewer per norm.
    """
    xf = x.float()
    return (xf * _inverse_rms(xf, eps)).mul_(scale).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a plain weight in the model dtype, then a SiLU gate: the Gated DeltaNet output norm.
    (In place after the cast: the normalised tensor is ours alone.)"""
    xf = x.float()
    y = (xf * _inverse_rms(xf, eps)).to(x.dtype).mul_(weight)
    return y.mul_(F.silu(gate.float()))


def _inverse_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """1 / sqrt(mean(x^2) + eps) over the last dim, as [..., 1]."""
    key = (eps, xf.device)
    eps_t = _EPS.get(key)
    if eps_t is None:
        eps_t = _EPS[key] = torch.tensor([eps], dtype=torch.float32, device=xf.device)
    return torch.add(eps_t, (xf * xf).sum(-1, keepdim=True), alpha=1.0 / xf.shape[-1]).rsqrt_()


_EPS: dict[tuple[float, torch.device], torch.Tensor] = {}


def rope_tables(max_len: int, rotary_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, fp32, shape [max_len, rotary_dim].

    Precomputed once so a decode step only gathers rows by the position counter.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    freqs = torch.arange(max_len, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.shape[-1]`` features of each head (partial rotary), keep the rest.

    x: [n, heads, head_dim]; cos, sin: [n, rotary_dim] already in x's dtype.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def swiglu_mlp(x: torch.Tensor, gate_up: Projection, down: Projection) -> torch.Tensor:
    """SwiGLU with gate and up fused into one [in, 2 * inter] matrix (one GEMM instead of two)."""
    gate, up = gate_up(x).chunk(2, dim=-1)
    return down(F.silu(gate, inplace=True).mul_(up))   # in place: the product is ours alone
