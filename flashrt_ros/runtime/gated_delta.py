"""The gated delta rule (Gated DeltaNet), in three forms that must agree.

Per value head the recurrent state ``S`` is a [key_dim, value_dim] matrix. For
each token with decay ``g`` (log space, <= 0) and write strength ``beta``::

    S     <- exp(g) * S
    delta  = beta * (v - S^T k)
    S     <- S + k delta^T
    o      = S^T q

``recurrent_step`` applies this to one token in place (decode). ``chunked``
processes a whole prompt on the torch path (a CPU engine with ``cpu_kernels``
runs prompts token after token in C instead, see ``backends.cpu.delta_step``): inside a chunk
of C tokens the recurrence is a small unit-lower-triangular system, solved with
one triangular solve, so the work is matrix products instead of C sequential
rank-one updates. ``reference`` is the token-by-token loop, kept only to check
the other two.

Shapes: q, k [n, Hk, dk]; v [n, H, dv]; g, beta [n, H]; state [H, dk, dv]; all
fp32, H a multiple of Hk. q and k are already L2-normalised and q is scaled.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

CHUNK = 64
# Decay factors below exp(-30) ~ 1e-13 sit far under fp32 resolution relative to
# the terms they are added to; they are set to exactly 0. Left in, their products
# become denormal floats, which x86 handles on a slow microcoded path, and the worker
# threads of a prefill do not inherit the caller's flush-to-zero setting.
_LOG_TINY = -30.0
_TINY = math.exp(_LOG_TINY)


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay) (log_decay <= 0), with factors below exp(_LOG_TINY) set to exactly 0.

    One threshold after the exp, where a mask before it would feed the exp -inf:
    torch's CPU exp takes a slow path on infinities (5x on a half-masked matrix),
    and boolean masks cost more than the exp itself.
    """
    return F.threshold_(log_decay.exp(), _TINY, 0.0)


L2_EPS = 1e-6   # the query and key normalisation's eps, as the reference model has it


def l2_normalize(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One token (n == 1); updates ``state`` in place and returns o [1, Hv, dv].

    q and k may have fewer heads than v (grouped value heads): each key head
    serves Hv // Hk consecutive value heads. Their rows are repeated once per
    value head (one copy of a few KiB) so that every product is a plain ``bmm``: with
    broadcasting, ``matmul`` copies its operands on each call, and a decode step is
    made of dispatches like these.
    """
    hk, dk = k.shape[1], k.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    qk = torch.cat((q, k)).view(2, hk, 1, 1, dk).expand(2, hk, hv // hk, 1, dk).reshape(2, hv, 1, dk)
    state.mul_(g.exp().view(hv, 1, 1))
    delta = (v.view(hv, 1, dv) - torch.bmm(qk[1], state)).mul_(beta.view(hv, 1, 1))
    state.baddbmm_(qk[1].transpose(1, 2), delta)         # S += k delta^T
    return torch.bmm(qk[0], state).view(1, hv, dv)


def _chunk_major(t: torch.Tensor, m: int, chunk: int, heads: int) -> torch.Tensor:
    """[m * chunk, h, d] -> contiguous [m, heads, chunk, d] in one copy; with h < heads each
    key head is repeated for the value heads that share it. Contiguous so that none of
    the batched products below copies its operands again."""
    h, d = t.shape[1], t.shape[2]
    t = t.reshape(m, chunk, h, 1, d).permute(0, 2, 3, 1, 4).expand(m, h, heads // h, chunk, d)
    return t.reshape(m, heads, chunk, d)


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """A run of n tokens; updates ``state`` in place and returns o [n, H, dv].

    Derivation, for one chunk starting from state S0, with G_i the cumulative
    log decay inside the chunk: the deltas satisfy (I + A) D = beta*V -
    beta*exp(G)*K S0, where A[i, j] = beta_i exp(G_i - G_j) k_i.k_j for j < i.
    Then O = exp(G) Q S0 + (Q K^T * exp(G_i - G_j), j <= i) D and the state
    after the chunk is exp(G_C) S0 + (K exp(G_C - G))^T D.
    """
    heads = v.shape[1]
    n, dv = k.shape[0], v.shape[2]
    pad = (-n) % chunk
    if pad:
        # Zero beta and zero decay make padded tokens exact no-ops.
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, 0, 0, pad)) for t in (g, beta))
    m = (n + pad) // chunk
    # [m, H, C, d]: each (chunk, head) is one batch entry, and chunk c is one contiguous block.
    q, k, v = (_chunk_major(t, m, chunk, heads) for t in (q, k, v))
    g, beta = (t.reshape(m, chunk, heads).transpose(1, 2) for t in (g, beta))

    cum = g.cumsum(-1)                                   # G_i
    # exp(G_i - G_j), used for j <= i only: the products below keep their lower triangle.
    # Above it G_i - G_j > 0 (G never increases, in floats too), clamped so exp cannot overflow.
    decay = _decay((cum[..., :, None] - cum[..., None, :]).clamp_(max=0.0))

    k_t = k.transpose(-1, -2)
    system = (k @ k_t).mul_(decay).mul_(beta[..., None]).tril_(-1)
    system.diagonal(dim1=-2, dim2=-1).fill_(1.0)         # I + A
    cum_decay = _decay(cum)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k * (beta * cum_decay)[..., None], upper=False, unitriangular=True)

    qk = (q @ k_t).mul_(decay).tril_()
    q_decayed = q * cum_decay[..., None]
    k_to_end_t = (k * _decay(cum[..., -1:] - cum)[..., None]).transpose(-1, -2)
    chunk_decay = cum_decay[..., -1, None, None]         # [m, H, 1, 1]

    # The only sequential part: three fused products per chunk (D, the output, the state).
    out = torch.empty(m, heads, chunk, dv, dtype=q.dtype, device=q.device)
    s = state
    for c in range(m):
        d = torch.baddbmm(u[c], w[c], s, alpha=-1.0)
        torch.baddbmm(torch.bmm(q_decayed[c], s), qk[c], d, out=out[c])
        s = torch.baddbmm(s * chunk_decay[c], k_to_end_t[c], d)
    state.copy_(s)
    return out.transpose(1, 2).reshape(m * chunk, heads, dv)[:n]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              beta: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """The definition, token by token and head by head: for tests only."""
    heads = v.shape[1]
    q, k = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (q, k))
    out = torch.empty_like(v)
    for t in range(v.shape[0]):
        for h in range(heads):
            s = state[h] * g[t, h].exp()
            delta = beta[t, h] * (v[t, h] - s.t() @ k[t, h])
            state[h] = s + torch.outer(k[t, h], delta)
            out[t, h] = state[h].t() @ q[t, h]
    return out
