"""An MoE model's execution state: the router keeps none, so its arena holds its dense twin's
regions, and capsules, rollback, fork and speculative decoding work on it unchanged: byte-exact
restores, rollback to any position, and speculative tokens and boundaries equal to plain greedy's."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashrt_ros.bench.known_drafts import KnownDrafts
from flashrt_ros.runtime import Engine
from flashrt_ros.runtime.backends import cpu as cpu_backend
from hf_reference import MOE_CONFIGS

needs_kernels = pytest.mark.skipif(not cpu_backend.serves(torch.device("cpu"), torch.float32),
                                   reason="the CPU backend's C library is not built")
MOE = MOE_CONFIGS["e8_top2_shared"]
PROMPT = list(range(3, 40))


def _engine(**options) -> Engine:
    return Engine.from_config(MOE, seed=1, max_seq_len=400, **options)


def _region_bytes(engine: Engine) -> dict[str, bytes]:
    return {r.name: view.contiguous().view(torch.uint8).numpy().tobytes()
            for r, view in engine.arena.live_views(engine.position)}


def _plain(engine: Engine, n: int) -> tuple[list[int], dict[int, str], list[float]]:
    """Greedy decode of n tokens after PROMPT: the tokens, the state digest at each boundary, the margins."""
    engine.reset()
    engine.prefill(PROMPT)
    tokens, digests, margins = [], {engine.position: engine.state_digest()}, []
    for token, margin, position in engine.stream(n, scored=True):
        tokens.append(token)
        margins.append(margin)
        digests[position] = engine.state_digest()
    return tokens, digests, margins


def test_the_arena_holds_the_dense_twins_regions():
    dense = dataclasses.replace(MOE, intermediate_size=64, num_experts=0, num_experts_per_tok=0,
                                moe_intermediate_size=0, shared_expert_intermediate_size=0)
    assert _engine().arena.region_table == Engine.from_config(dense, max_seq_len=400).arena.region_table


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_restore_is_byte_exact_and_continues_token_for_token(tier, tmp_path):
    engine = _engine(capsule_dir=tmp_path)
    engine.prefill(PROMPT)
    engine.generate(5)
    before, digest = _region_bytes(engine), engine.state_digest()
    capsule = engine.snapshot(tier=tier)
    first = engine.generate(20)
    engine.prefill([7, 7, 7])
    engine.restore(capsule, verify=True)
    assert _region_bytes(engine) == before and engine.state_digest() == digest
    assert engine.generate(20) == first
    if tier == "disk":   # a new engine reads the file and goes on as this one did
        other = _engine(capsule_dir=tmp_path)
        other.restore(capsule.id)
        assert other.state_digest() == digest and other.generate(20) == first


def test_rollback_to_every_position_gives_the_state_the_run_had_there():
    """Every decode position (a few through the ring, most by replaying the logged inputs from a
    restored end state), and positions inside the prompt, which equal a cold prefill."""
    engine = _engine(rollback_depth=4)
    tokens, digests, _ = _plain(engine, 24)
    end = engine.snapshot()
    for p in sorted(digests, reverse=True)[:4]:   # the ring, one boundary at a time
        assert engine.rollback(to_position=p) == p and engine.state_digest() == digests[p]
    for p in sorted(digests):
        engine.restore(end)
        assert engine.rollback(to_position=p) == p
        assert engine.state_digest() == digests[p], p
    for p in (1, 16, len(PROMPT) - 1):
        engine.restore(end)
        engine.rollback(to_position=p)
        cold = _engine()
        cold.prefill(PROMPT[:p])
        assert engine.state_digest() == cold.state_digest()
        assert engine.generate(8) == cold.generate(8)


def test_a_fork_continues_as_its_parent_would_and_branches_apart():
    engine = _engine()
    engine.prefill(PROMPT)
    parent = engine.snapshot("parent")
    child = engine.fork(parent, "child")
    after_parent = engine.generate(12)
    engine.restore(child)
    assert engine.generate(12) == after_parent
    engine.restore(child)
    engine.prefill([250, 251, 252])
    branch = engine.generate(12)
    cold = _engine()
    cold.prefill(PROMPT + [250, 251, 252])
    assert cold.generate(12) == branch


def _speculative(engine: Engine, n: int, k: int, digests: dict[int, str]) -> tuple[list[int], int]:
    """Speculative decode of n tokens; each boundary a pass ends on is checked against plain decode's."""
    engine.reset()
    engine.prefill(PROMPT)
    tokens, checked = [], 0
    for token in engine.stream(n, speculative=k):
        tokens.append(token)
        if engine.position == len(PROMPT) + len(tokens):
            assert engine.state_digest() == digests[engine.position], f"state differs at {engine.position}"
            checked += 1
    return tokens, checked


@needs_kernels
@pytest.mark.parametrize("options", [{}, {"static_shapes": True}], ids=["grouped", "gathered_fixed_shapes"])
def test_speculative_tokens_and_boundaries_equal_plain_greedy(options):
    """Drafts from plain decode's own continuation, a fifth of them wrong (the MTP layer's MoE
    block still runs each draft step); tokens and every pass's end state are plain decode's."""
    engine = _engine(**options)
    plain, digests, _ = _plain(engine, 120)
    engine.speculation.drafter = KnownDrafts(engine.speculation, plain, len(PROMPT), 0.2, MOE.vocab_size)
    for k in (1, 3):
        before = engine.speculation_stats
        tokens, checked = _speculative(engine, 120, k, digests)
        after = engine.speculation_stats
        assert tokens == plain
        assert 0 < after.accepted - before.accepted < after.drafted - before.drafted, "both outcomes exercised"
        assert checked >= (after.passes - before.passes) // 2
        for _ in range(engine.rollback_depth):   # every boundary the ring kept is plain decode's too
            engine.rollback(1)
            assert engine.state_digest() == digests[engine.position]


def test_torch_reference_path_speculative_tokens_agree_where_the_margin_exceeds_its_rounding():
    """torch's product of n rows may round otherwise than of one: tokens agree wherever plain
    decode's margin is above that rounding (no digest check)."""
    engine = _engine(cpu_kernels=False)
    plain, _, margins = _plain(engine, 120)
    engine.speculation.drafter = KnownDrafts(engine.speculation, plain, len(PROMPT), 0.2, MOE.vocab_size)
    engine.reset()
    engine.prefill(PROMPT)
    tokens = engine.generate(120, speculative=3)
    first = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), None)
    assert first is None or margins[first] < 1e-3, (first, margins[first] if first is not None else None)


def test_distilling_an_moe_models_mtp_layer_is_refused_by_name():
    from flashrt_ros.distill.mtp_layer import MtpLayer
    from flashrt_ros.errors import InvalidArgument

    embed = torch.zeros(MOE.vocab_size, MOE.hidden_size)
    with pytest.raises(InvalidArgument, match="mixture-of-experts model is not supported"):
        MtpLayer(MOE, {}, embed, embed, max_len=8)
