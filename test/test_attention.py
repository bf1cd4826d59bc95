"""Attention of a prefill chunk after a prefix: the CPU's two merged passes and the masked pass."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.runtime import attention
from flashrt_ros.runtime.attention import Span, write_and_attend


def _exact(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax attention in float64: query i (row start + i) sees rows [0, start + i]."""
    n, hq, d = q.shape
    group = hq // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1).transpose(0, 1)
    v = values.double().repeat_interleave(group, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) * d ** -0.5
    rows, queries = torch.arange(start + n), torch.arange(start, start + n)
    scores = scores.masked_fill(rows[None, :] > queries[:, None], float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, hq * d)


@pytest.mark.parametrize("n, start, hq, hkv, d", [(64, 2048, 8, 2, 64), (5, 1, 4, 4, 32), (17, 300, 6, 3, 32),
                                                  (2, 7, 4, 1, 16)])
@pytest.mark.parametrize("merged", [True, False])
def test_a_chunk_after_a_prefix_sees_the_prefix_and_its_own_rows_causally(n, start, hq, hkv, d, merged, monkeypatch):
    if merged:
        assert attention._FLASH_CPU is not None, "this torch has no CPU flash op: chunks take the masked pass"
    else:
        monkeypatch.setattr(attention, "_FLASH_CPU", None)
    gen = torch.Generator().manual_seed(n * 1000 + start)
    q = torch.randn(n, hq, d, generator=gen)
    k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    k_cache = torch.randn(start + n + 3, hkv, d, generator=gen)   # rows past the chunk must stay unread
    v_cache = torch.randn(start + n + 3, hkv, d, generator=gen)
    out = write_and_attend(q, k, v, k_cache, v_cache, torch.arange(start, start + n),
                           Span.prefill(start, n, q.device))
    assert torch.equal(k_cache[start:start + n], k) and torch.equal(v_cache[start:start + n], v)
    expected = _exact(q, k_cache[:start + n], v_cache[:start + n], start)
    assert (out.double() - expected).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_chunk_after_a_prefix_keeps_a_half_precision_dtype(dtype):
    # The flash op's log-sum-exps are float32 whatever the inputs: merged with them unconverted,
    # the output came back float32, and the next projection, in the engine's dtype, refused it.
    gen = torch.Generator().manual_seed(3)
    n, start, hq, hkv, d = 9, 40, 4, 2, 32
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k, v = torch.randn(n, hkv, d, generator=gen).to(dtype), torch.randn(n, hkv, d, generator=gen).to(dtype)
    k_cache = torch.randn(start + n, hkv, d, generator=gen).to(dtype)
    v_cache = torch.randn(start + n, hkv, d, generator=gen).to(dtype)
    out = write_and_attend(q, k, v, k_cache, v_cache, torch.arange(start, start + n), Span.prefill(start, n, q.device))
    assert out.dtype == dtype
    assert (out.double() - _exact(q, k_cache, v_cache, start)).abs().max() < 0.05


def test_a_chunk_whose_rows_are_strided_takes_the_masked_pass(monkeypatch):
    # The flash op reads a last dimension with a stride as if it had none (garbage out).
    called = []
    monkeypatch.setattr(attention, "_attend_after_prefix", lambda *a: called.append(a))
    gen = torch.Generator().manual_seed(4)
    n, start, hq, hkv, d = 6, 20, 4, 2, 16
    q = torch.randn(n, hq, 2 * d, generator=gen)[..., ::2]
    k, v = torch.randn(n, hkv, d, generator=gen), torch.randn(n, hkv, d, generator=gen)
    k_cache, v_cache = torch.randn(start + n, hkv, d, generator=gen), torch.randn(start + n, hkv, d, generator=gen)
    out = write_and_attend(q, k, v, k_cache, v_cache, torch.arange(start, start + n), Span.prefill(start, n, q.device))
    assert not called
    assert (out.double() - _exact(q, k_cache, v_cache, start)).abs().max() < 1e-5


def test_a_chunk_after_a_prefix_carries_its_mask_only_where_the_masked_pass_runs():
    assert Span.prefill(40, 9, torch.device("cpu")).mask is None   # a CPU merges two unmasked passes
    span = Span.prefill(40, 9, torch.device("meta"))   # another device: built once for every layer
    assert span.own == 9 and span.mask is not None and tuple(span.mask.shape) == (9, 49)
