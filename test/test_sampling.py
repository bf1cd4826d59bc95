"""Sampled decoding: its RNG state lives in the arena, so capsules, rollback and replay draw
the same tokens again; the draws follow softmax(logits / temperature)."""
from __future__ import annotations

import math

import pytest
import torch

from flashrt_ros.errors import ErrorCode, InvalidArgument
from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.sampling import gumbel_noise

PROMPT = list(b"Pick the red cube, then ")


@pytest.fixture
def engine():
    e = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    e.prefill(PROMPT)
    return e


def test_the_noise_is_gumbel_and_each_seed_and_position_draws_anew():
    index = torch.arange(40_000)
    noise = gumbel_noise(torch.tensor([7]), torch.tensor([3]), index)
    assert abs(noise.mean().item() - 0.5772) < 0.03 and abs(noise.var().item() - math.pi ** 2 / 6) < 0.08
    for seed, position in [(8, 3), (7, 4), (7 + 2**40, 3)]:   # the seed's high bits count too
        other = gumbel_noise(torch.tensor([seed]), torch.tensor([position]), index)
        assert abs(torch.corrcoef(torch.stack([noise, other]))[0, 1].item()) < 0.03
    assert torch.equal(noise, gumbel_noise(torch.tensor([7]), torch.tensor([3]), index))


def test_draws_follow_the_softmax_at_the_temperature():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    positions = torch.arange(30_000)[:, None]          # one draw per position, all at once
    draws = (logits.double() / 0.7 + gumbel_noise(torch.tensor([1]), positions, torch.arange(4))).argmax(-1)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert torch.allclose(freq, torch.softmax(logits.double() / 0.7, -1), atol=0.01)


def test_a_capsule_carries_the_rng_state_and_draws_the_same_tokens_again(engine, tmp_path):
    greedy = engine.generate(16)
    engine.rollback(to_position=len(PROMPT))
    assert engine.generate(16, temperature=0.0) == greedy
    engine.rollback(to_position=len(PROMPT))
    first = engine.generate(4, temperature=1.0, seed=11)
    mid = engine.snapshot("mid")
    assert engine.sampling_seed == 11
    a = engine.generate(24, temperature=1.0)
    assert a != greedy[4:28] and len(set(a)) > 4            # sampled, not greedy
    engine.generate(5, temperature=1.0, seed=99)            # other work, another seed
    engine.restore(mid)
    assert engine.sampling_seed == 11 and engine.generate(24, temperature=1.0) == a
    # The same draws from the same seed on a fresh engine; another seed draws otherwise.
    fresh = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    fresh.prefill(PROMPT)
    assert fresh.generate(28, temperature=1.0, seed=11) == first + a
    fresh.rollback(to_position=len(PROMPT))
    assert fresh.generate(28, temperature=1.0, seed=12) != first + a


def test_rollback_into_sampled_tokens_is_the_state_the_run_had_there(engine):
    engine.generate(6, temperature=1.5, seed=3)
    there = engine.position
    digest = engine.state_digest()
    after = engine.generate(6, temperature=1.5)
    engine.generate(4, temperature=0.3)
    assert engine.rollback(to_position=there) == there      # replays the logged tokens
    assert engine.state_digest() == digest and engine.generate(6, temperature=1.5) == after
    engine.rollback(steps=6)
    assert engine.state_digest() == digest


def test_graph_shaped_decode_draws_what_eager_decode_draws():
    tokens = []
    for static in (False, True):
        e = Engine.from_config(ModelConfig.tiny(), max_seq_len=128, static_shapes=static)
        e.prefill(PROMPT)
        tokens.append(e.generate(16, temperature=1.0, seed=5))
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-300])
def test_a_temperature_near_zero_draws_the_greedy_token(engine, temperature):
    """Below float32's range (1e-40) it once flushed to 0: logits / 0 gave +inf at every
    positive logit, and the first of them won, not the largest."""
    start = engine.snapshot()
    greedy = engine.generate(3)
    engine.restore(start)
    assert engine.generate(3, temperature=temperature, seed=7) == greedy


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.5}, {"temperature": float("nan")}, {"temperature": float("inf")},
    {"temperature": True}, {"temperature": "1"}, {"seed": -1}, {"seed": 2**63}, {"seed": 1.0},
    {"seed": True},
])
def test_bad_sampling_arguments_are_refused_before_anything_is_committed(engine, kwargs):
    before, seed = engine.state_digest(), engine.sampling_seed
    with pytest.raises(InvalidArgument) as info:
        engine.generate(3, **kwargs)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert engine.state_digest() == before and engine.sampling_seed == seed
