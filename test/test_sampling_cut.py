"""Top-k and top-p sampling: the tokens kept are transformers' warpers' own, every draw lands
inside the cut, a capsule, a rollback, a graph-shaped step and a speculative pass draw the same
tokens again, a journal records the cut and replays it, and a checkpoint's
generation_config.json gives its sampling defaults."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flashrt_ros.errors import CheckpointError, ErrorCode, InvalidArgument
from flashrt_ros.runtime import GREEDY, Engine, ModelConfig, Sampling
from flashrt_ros.runtime.sampling import gumbel_noise, scores, threshold
from flashrt_ros.runtime.weights import save_checkpoint, seeded_weights

PROMPT = list(b"Pick the red cube, then ")
CUTS = [(0, 1.0), (1, 1.0), (5, 1.0), (40, 1.0), (0, 0.5), (0, 0.9), (0, 0.999), (10, 0.8), (3, 0.95), (0, 1e-9)]


@pytest.fixture
def engine():
    e = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    e.prefill(PROMPT)
    return e


def _kept_by_transformers(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    out = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_k:
        out = TopKLogitsWarper(top_k)(None, out)
    if top_p < 1:
        out = TopPLogitsWarper(top_p)(None, out)
    return torch.isfinite(out[0])


@pytest.mark.parametrize("top_k, top_p", CUTS)
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_the_tokens_kept_are_the_ones_transformers_warpers_keep(top_k, top_p, temperature):
    gen = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100))
    for spread in (0.5, 3.0, 12.0):   # flat to peaked distributions
        logits = (torch.randn(2000, generator=gen, dtype=torch.float64) * spread)
        scaled = (logits - logits.max()) / temperature
        cut = threshold(scaled, torch.tensor([top_k]), torch.tensor([top_p], dtype=torch.float64))
        kept = scaled >= cut
        assert torch.equal(kept, _kept_by_transformers(logits, temperature, top_k, top_p))


def test_draws_follow_the_softmax_renormalised_over_the_cut():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.2, -1.0, -3.0]])
    cut = (torch.tensor([4]), torch.tensor([0.9], dtype=torch.float64))
    index = torch.arange(6)
    draws = torch.stack([scores(logits, torch.tensor([0.8], dtype=torch.float64), torch.tensor([1]),
                                torch.tensor([p]), index, cut).argmax() for p in range(20_000)])
    freq = torch.bincount(draws, minlength=6).double() / draws.numel()
    scaled = logits[0].double() / 0.8
    kept = _kept_by_transformers(logits[0].double(), 0.8, 4, 0.9)
    want = torch.softmax(scaled.masked_fill(~kept, -math.inf), -1)
    assert kept.sum() < 6 and torch.allclose(freq, want, atol=0.012)
    # Without the cut the same noise draws from every token.
    plain = torch.stack([(scaled + gumbel_noise(torch.tensor([1]), torch.tensor([p]), index)).argmax()
                         for p in range(2_000)])
    assert set(plain.tolist()) - set(torch.nonzero(kept).flatten().tolist())


def test_every_draw_lands_inside_the_cut_and_a_cut_of_one_is_greedy(engine):
    start = engine.snapshot()
    greedy = engine.generate(12)
    engine.restore(start)
    assert engine.generate(12, temperature=3.0, top_k=1, seed=4) == greedy
    engine.restore(start)
    assert engine.generate(12, temperature=3.0, top_p=1e-9, seed=4) == greedy
    engine.restore(start)
    engine.generate(1, temperature=3.0, seed=4)   # sets the seed
    outside = 0
    for _ in range(40):
        top3 = set(engine.logits().topk(3).indices.tolist())
        token = engine.generate(1, temperature=3.0, top_k=3)[0]
        assert token in top3
        probe = engine.snapshot()
        engine.rollback(steps=1)
        outside += engine.generate(1, temperature=3.0)[0] not in top3   # the same noise, uncut
        engine.restore(probe)
        engine.capsules.drop(probe)
    assert outside > 0, "at this temperature an uncut draw leaves the top 3: the cut did something"


def test_a_capsule_and_a_rollback_draw_the_same_cut_tokens_again(engine):
    how = {"temperature": 1.2, "top_k": 8, "top_p": 0.9}
    engine.generate(3, **how, seed=21)
    mid = engine.snapshot()
    there, digest = engine.position, engine.state_digest()
    after = engine.generate(16, **how)
    engine.generate(4, temperature=0.7, seed=5)
    engine.restore(mid)
    assert engine.generate(16, **how) == after
    engine.rollback(to_position=there)
    assert engine.state_digest() == digest and engine.generate(16, **how) == after


def test_graph_shaped_and_speculative_decode_draw_what_eager_decode_draws():
    tokens = []
    for static in (False, True):
        e = Engine.from_config(ModelConfig.tiny(), max_seq_len=128, static_shapes=static)
        e.prefill(PROMPT)
        tokens.append(e.generate(24, temperature=1.0, top_k=6, top_p=0.85, seed=5))
        e.reset()
        e.prefill(PROMPT)
        tokens.append(e.generate(24, temperature=1.0, top_k=6, top_p=0.85, seed=5, speculative=2))
    assert all(t == tokens[0] for t in tokens)


@pytest.mark.parametrize("kwargs", [
    {"top_k": -1}, {"top_k": 1.5}, {"top_k": True}, {"top_k": 2**31}, {"top_p": 0.0}, {"top_p": 1.5},
    {"top_p": float("nan")}, {"top_p": -0.1}, {"top_p": "0.9"},
])
def test_bad_cuts_are_refused_before_anything_is_committed(engine, kwargs):
    before = engine.state_digest()
    with pytest.raises(InvalidArgument) as info:
        engine.generate(3, temperature=1.0, **kwargs)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT and engine.state_digest() == before


def test_a_journal_records_the_cut_and_replays_it_exactly(tmp_path):
    from flashrt_ros.replay import Journal
    from flashrt_ros.replay.bag import read_bag, write_bag
    from flashrt_ros.replay.cli import main as replay_main
    from flashrt_ros.replay.session import session_of
    from flashrt_ros.serving.session import Session

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    session = Session(engine, Journal(session=session_of(engine, "", 0)))
    list(session.generate([256, 5, 9], 6, Sampling(0.9, 5, 0.8), seed=3))
    list(session.generate([], 4, Sampling(1.1, 0, 0.7)))
    decodes = [e.request for e in read_bag(write_bag(tmp_path / "bag", session.journal)).entries if e.kind == "decode"]
    assert decodes[0] == {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "seed": 3}
    assert decodes[6] == {"temperature": 1.1, "top_p": 0.7}
    assert replay_main([str(tmp_path / "bag")]) == 0


def _folder(tmp_path, generation: dict | str | None):
    cfg = ModelConfig.tiny()
    save_checkpoint(tmp_path, cfg, seeded_weights(cfg, 0))
    if generation is not None:
        text = generation if isinstance(generation, str) else json.dumps(generation)
        (tmp_path / "generation_config.json").write_text(text)
    return tmp_path


@pytest.mark.parametrize("generation, defaults", [
    (None, GREEDY),
    ({"eos_token_id": 3}, GREEDY),
    ({"do_sample": False, "temperature": 0.6, "top_k": 20}, GREEDY),
    ({"do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}, Sampling(0.6, 20, 0.95)),
    ({"do_sample": True}, Sampling(1.0, 50, 1.0)),   # transformers' defaults for the rest
])
def test_a_checkpoint_gives_its_sampling_defaults(tmp_path, generation, defaults):
    engine = Engine.from_pretrained(_folder(tmp_path, generation), max_seq_len=64)
    assert engine.sampling_defaults == defaults
    engine.prefill(PROMPT)
    engine.generate(8, **engine.sampling_defaults.as_kwargs(), seed=1)


@pytest.mark.parametrize("generation, words", [
    ({"do_sample": True, "temperature": 0}, "do_sample with temperature 0"),
    ({"do_sample": True, "top_p": 0}, "top_p must be a number in"),
    ({"do_sample": True, "top_k": -5}, "top_k must be an int"),
    ({"do_sample": True, "temperature": "hot"}, "temperature must be"),
    ("[1, 2]", "not a JSON object"),
])
def test_bad_sampling_defaults_are_refused_by_name(tmp_path, generation, words):
    with pytest.raises(CheckpointError, match=words) as info:
        Engine.from_pretrained(_folder(tmp_path, generation), max_seq_len=64)
    assert "generation_config.json" in str(info.value)


def test_a_generate_goal_samples_as_the_checkpoint_or_as_it_asks_over_dds(ros_context, tmp_path):
    """temperature -1: the checkpoint's generation_config.json sampling; the same tokens as a goal
    that spells those values out (exact in float32: the goal's fields are), and as the engine
    gives in this process. A bad cut fails the goal and leaves the state alone."""
    pytest.importorskip("rclpy")
    from ros_harness import Harness, wait_future

    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.75, "top_k": 5, "top_p": 0.875})
    local = Engine.from_pretrained(folder, max_seq_len=256)
    local.prefill(PROMPT)
    want = local.generate(6, **local.sampling_defaults.as_kwargs(), seed=9)
    h = Harness(ros_context, {"model_path": str(folder)})
    try:
        def run(**fields):
            _, result = h.generate(token_ids=PROMPT, max_new_tokens=6, seed=9, **fields)
            return wait_future(result, 60).result

        mark = h.call("snapshot", lease_s=0.0)
        as_released = run(temperature=-1.0)
        assert as_released.success, as_released.message
        assert list(as_released.tokens) == want
        assert h.call("restore", capsule_id=mark.capsule_id).success
        spelled = run(temperature=0.75, top_k=5, top_p=0.875)
        assert spelled.success and list(spelled.tokens) == want
        assert h.call("restore", capsule_id=mark.capsule_id).success
        greedy = run()
        local.reset()
        local.prefill(PROMPT)
        assert greedy.success and list(greedy.tokens) == local.generate(6)
        refused = run(temperature=1.0, top_p=1.5)
        assert not refused.success and refused.error_code == ErrorCode.INVALID_ARGUMENT
        assert "top_p" in refused.message and refused.position == greedy.position
    finally:
        h.close()
