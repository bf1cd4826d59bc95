"""The chunked and recurrent gated delta rule agree with the token-by-token definition."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.runtime import gated_delta


def _inputs(n: int, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = gated_delta.l2_normalize(torch.randn(n, hk, dk, generator=gen)) * dk ** -0.5
    k = gated_delta.l2_normalize(torch.randn(n, hk, dk, generator=gen))
    v = torch.randn(n, hv, dv, generator=gen)
    g = -torch.rand(n, hv, generator=gen) * 2
    beta = torch.rand(n, hv, generator=gen)
    state = torch.randn(hv, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("n", [1, 63, 64, 65, 200])
def test_chunked_matches_definition_with_initial_state_and_grouped_heads(n):
    q, k, v, g, beta, state = _inputs(n)
    ours, ref = state.clone(), state.clone()
    out = gated_delta.chunked(q, k, v, g, beta, ours)
    expected = gated_delta.reference(q, k, v, g, beta, ref)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_recurrent_steps_match_definition():
    q, k, v, g, beta, state = _inputs(40, seed=1)
    ours, ref = state.clone(), state.clone()
    outs = [gated_delta.recurrent_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], ours)
            for t in range(40)]
    expected = gated_delta.reference(q, k, v, g, beta, ref)
    assert torch.allclose(torch.cat(outs), expected, atol=1e-5)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_chunked_split_across_calls_carries_the_state():
    q, k, v, g, beta, state = _inputs(150, seed=2)
    whole, parts = state.clone(), state.clone()
    out_whole = gated_delta.chunked(q, k, v, g, beta, whole)
    out_parts = torch.cat([gated_delta.chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], parts)
                           for a, b in ((0, 37), (37, 101), (101, 150))])
    assert torch.allclose(out_whole, out_parts, atol=1e-5)
    assert torch.allclose(whole, parts, atol=1e-5)
