"""Attention over the KV rows that live in the arena.

KV rows are written in place at their positions (``index_copy_`` with a device
tensor, so a captured graph can write them), then attention reads a prefix of
the cache. How long that prefix is, and how it is masked, is the only thing
that differs between prefill, eager decode and graphed decode: a ``Span``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class Span:
    """Which cache rows the current queries read.

    length: rows [0, length) are read. mask: bool [n, length] (True = attend),
    or None; causal: top-left causal mask, used only when the queries start at
    row 0 (the fast path for a first prefill).
    """

    length: int
    mask: torch.Tensor | None = None
    causal: bool = False

    @staticmethod
    def prefill(start: int, n: int, device: torch.device) -> "Span":
        if start == 0:
            return Span(n, None, causal=n > 1)
        rows = torch.arange(start + n, device=device)
        queries = torch.arange(start, start + n, device=device)
        return Span(start + n, rows[None, :] <= queries[:, None])

    @staticmethod
    def decode(position: int) -> "Span":
        """Eager decode: read exactly the live rows, host-known length."""
        return Span(position + 1)

    @staticmethod
    def fixed(rows: torch.Tensor, position: torch.Tensor) -> "Span":
        """Graph decode: always read every row and mask by the device position counter."""
        return Span(rows.shape[0], (rows <= position)[None, :])


def write_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor,
                     positions: torch.Tensor, span: Span) -> torch.Tensor:
    """q [n, Hq, D]; k, v [n, Hkv, D]; caches [S, Hkv, D] (views into the arena).

    Returns [n, Hq * D].
    """
    k_cache.index_copy_(0, positions, k)
    v_cache.index_copy_(0, positions, v)
    keys = k_cache[:span.length].transpose(0, 1)
    values = v_cache[:span.length].transpose(0, 1)
    mask = None if span.mask is None else span.mask[None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=span.causal,
        scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.transpose(0, 1).reshape(q.shape[0], -1)
