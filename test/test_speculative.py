"""Speculative decoding with the MTP layer: plain decode's tokens, and plain decode's state bytes at
every committed boundary, on the CPU backend; capsules, rollback and journals see only those
boundaries.

A seeded MTP head drafts almost nothing a random model accepts (and a random model's next token
is not learnable: test_distilled_head_loads_and_decodes_exactly), so the exactness tests draw
their drafts from plain decode's own continuation, a fifth of them wrong (``KnownDrafts``): the MTP layer
still runs each draft step (and writes its KV rows), and the verify, the acceptance and the
step back after a wrong draft are the engine's own.
"""
from __future__ import annotations

import threading

import pytest
import torch

from flashrt_ros.errors import InvalidArgument, Preempted
from flashrt_ros.replay import Journal, judge
from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime import mtp_head
from flashrt_ros.runtime.backends import cpu as cpu_backend
from flashrt_ros.bench.known_drafts import KnownDrafts
from flashrt_ros.resources import package_file
from flashrt_ros.serving.session import Session
from hf_reference import CONFIGS, save_hf_model

needs_kernels = pytest.mark.skipif(not cpu_backend.serves(torch.device("cpu"), torch.float32),
                                   reason="the CPU backend's C library is not built")
PROMPT = [256, 7, 21, 99, 3]


def _plain(engine: Engine, prompt: list[int], n: int) -> tuple[list[int], dict[int, str], list[float]]:
    """Plain greedy decode of n tokens: the tokens, the state digest at each boundary, the margins."""
    engine.reset()
    engine.prefill(prompt)
    tokens, digests, margins = [], {}, []
    for token, margin, position in engine.stream(n, scored=True):
        tokens.append(token)
        margins.append(margin)
        digests[position] = engine.state_digest()
    return tokens, digests, margins


def _known_drafts(engine: Engine, prompt: list[int], plain: list[int], wrong: float = 0.2) -> None:
    """Drafts from the plain continuation, a share ``wrong`` of them one token off."""
    engine.speculation.drafter = KnownDrafts(engine.speculation, plain, len(prompt), wrong,
                                             engine.config.vocab_size)


def _speculative(engine: Engine, prompt: list[int], n: int, k: int, digests: dict[int, str]) -> tuple[list, int]:
    """Speculative decode of n tokens; checks the digest at every boundary a pass ends on."""
    engine.reset()
    engine.prefill(prompt)
    tokens, checked = [], 0
    for token in engine.stream(n, speculative=k):
        tokens.append(token)
        if engine.position == len(prompt) + len(tokens):   # the last token of a pass: the live boundary
            assert engine.state_digest() == digests[engine.position], f"state differs at {engine.position}"
            checked += 1
    # Every boundary the ring kept, one token each, is plain decode's too.
    for _ in range(engine.rollback_depth):
        engine.rollback(1)
        assert engine.state_digest() == digests[engine.position]
    return tokens, checked


def _exact(engine: Engine, prompt: list[int], n: int, drafts: tuple[int, ...]) -> None:
    plain, digests, _ = _plain(engine, prompt, n)
    _known_drafts(engine, prompt, plain)
    for k in drafts:
        before = engine.speculation_stats
        tokens, checked = _speculative(engine, prompt, n, k, digests)
        after = engine.speculation_stats
        assert tokens == plain
        accepted, passes = after.accepted - before.accepted, after.passes - before.passes
        assert accepted > 0 and accepted < after.drafted - before.drafted, "both outcomes must be exercised"
        assert checked >= passes // 2


@needs_kernels
def test_embedded_default_speculative_equals_plain_token_for_token_and_byte_for_byte():
    """2400 tokens: 600 per drafts-per-pass, a digest at every boundary a pass ends on."""
    _exact(Engine.from_config(ModelConfig.tiny(), max_seq_len=700), PROMPT, 600, (1, 2, 3, 4))


@needs_kernels
def test_a_trained_model_with_its_distilled_head_is_exact_and_its_drafts_are_accepted():
    """data/spec_tiny: the embedded default's backbone trained on Python source, with the head
    flashrt-train-mtp distilled from it (the head file in the checkpoint folder): real drafts,
    most of them accepted, and 4 x 250 tokens with plain decode's tokens and states."""
    engine = Engine.from_pretrained(package_file("data/spec_tiny"), max_seq_len=400)
    for text in (b"import os\n\n\ndef ", b"class Reader:\n    def __init__(self", b"    return self.",
                 b"# Copyright 2001 Python Software Foundation\n"):
        prompt = [256, *text]
        plain, digests, _ = _plain(engine, prompt, 250)
        before = engine.speculation_stats
        tokens, checked = _speculative(engine, prompt, 250, 3, digests)
        assert tokens == plain and checked > 0
    stats = engine.speculation_stats
    assert stats.passes > before.passes and stats.acceptance > 0.5, stats


@needs_kernels
def test_fixed_shape_decode_speculative_equals_plain():
    """The masked spans a CUDA graph needs, on a CPU: the verify's rows take them too."""
    _exact(Engine.from_config(ModelConfig.tiny(), max_seq_len=400, static_shapes=True), PROMPT, 300, (2,))


@needs_kernels
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_random_transformers_models_speculative_equals_plain(name, tmp_path):
    """Checkpoints saved by transformers (no mtp.*: the engine seeds the layer), 300 tokens each."""
    cfg = CONFIGS[name]
    save_hf_model(cfg, seed=1, path=tmp_path)
    engine = Engine.from_pretrained(tmp_path, max_seq_len=400)
    _exact(engine, [1, 2, 3, 4, 5, 6], 300, (3,))


@needs_kernels
def test_bench_config_speculative_equals_plain():
    _exact(Engine.from_config(ModelConfig.bench(), max_seq_len=256), PROMPT, 160, (3,))


@needs_kernels
def test_sampled_speculative_draws_the_tokens_plain_sampling_draws():
    """The draw at a position is a function of the logits, the seed and the position, so a
    verify row draws what the decode step at that row would."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=300)
    engine.prefill(PROMPT)
    plain = engine.generate(200, temperature=0.8, seed=42)
    _known_drafts(engine, PROMPT, plain)
    engine.reset()
    engine.prefill(PROMPT)
    assert engine.generate(200, temperature=0.8, seed=42, speculative=2) == plain
    assert engine.speculation_stats.accepted > 0


def test_torch_reference_path_tokens_agree_where_the_margin_exceeds_its_rounding():
    """torch's product of n rows may round otherwise than of one: the state differs in low bits
    (no digest check) and tokens agree wherever plain decode's margin is above TOLERANCE."""
    tolerance = 1e-3
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=500, cpu_kernels=False)
    plain, _, margins = _plain(engine, PROMPT, 400)
    _known_drafts(engine, PROMPT, plain)
    engine.reset()
    engine.prefill(PROMPT)
    tokens = engine.generate(400, speculative=3)
    first = next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), None)
    assert first is None or margins[first] < tolerance, (first, margins[first] if first is not None else None)
    assert first is None, "no near-tie on this run: the tokens are all equal"


@needs_kernels
def test_capsules_taken_during_speculative_decoding_hold_committed_boundaries_only():
    """A thread snapshots as fast as it can while another decodes speculatively: every capsule
    is a boundary plain decode passes (its digest), and restoring one gives that state."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=700)
    plain, digests, _ = _plain(engine, PROMPT, 500)
    _known_drafts(engine, PROMPT, plain)
    engine.reset()
    engine.prefill(PROMPT)
    taken, stop = [], threading.Event()

    def snapshots():
        while not stop.is_set():
            taken.append(engine.snapshot(tier="host"))

    thread = threading.Thread(target=snapshots)
    thread.start()
    try:
        tokens = engine.generate(500, speculative=3)
    finally:
        stop.set()
        thread.join()
    assert tokens == plain
    inside = [c for c in taken if len(PROMPT) < c.position < len(PROMPT) + 500]
    assert inside, "no snapshot landed during the stream"
    for info in inside:
        assert engine.capsules.get(info.id).digest == digests[info.position]
    engine.restore(inside[len(inside) // 2].id, verify=True)
    assert engine.state_digest() == digests[engine.position]


@needs_kernels
def test_rollback_steps_count_committed_tokens():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=300, rollback_depth=16)
    plain, digests, _ = _plain(engine, PROMPT, 100)
    _known_drafts(engine, PROMPT, plain)
    engine.reset()
    engine.prefill(PROMPT)
    engine.generate(100, speculative=4)
    end = engine.position
    for steps in (1, 3, 7):
        assert engine.rollback(steps=steps) == end - steps
        assert engine.state_digest() == digests[end - steps]
        end -= steps
    assert engine.rollback(to_position=len(PROMPT) + 40) == len(PROMPT) + 40   # the log replays too
    assert engine.state_digest() == digests[len(PROMPT) + 40]


def test_a_restore_between_passes_stops_the_stream():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=300)
    engine.prefill(PROMPT)
    made = engine.snapshot()
    stream = engine.stream(50, speculative=2)
    got = [next(stream)]
    engine.restore(made.id)
    with pytest.raises(Preempted):
        got += list(stream)
    assert engine.position == len(PROMPT)


@needs_kernels
def test_a_speculative_sessions_journal_replays_exactly():
    """Its tokens are journaled one entry each, at the positions they left; replayed as plain
    decode steps they give the same tokens and states."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=400)
    plain, _, _ = _plain(engine, PROMPT, 120)
    engine.reset()
    _known_drafts(engine, PROMPT, plain)
    session = Session(engine, Journal())
    assert list(session.generate(PROMPT, 60, speculative=3)) == plain[:60]
    made = session.snapshot(name="mid")
    session.rollback(steps=5)
    assert list(session.generate([], 65, speculative=2)) == plain[55:120]
    session.restore(made.info.id)
    decodes = [e for e in session.journal.entries if e.kind == "decode"]
    assert [e.outcome["position"] for e in decodes[:60]] == list(range(len(PROMPT) + 1, len(PROMPT) + 61))
    verdict = judge(session.journal.entries, Engine.from_config(ModelConfig.tiny(), max_seq_len=400))
    assert verdict.exact and verdict.tokens == 125, verdict.findings


def test_bad_requests_are_refused_before_anything_is_committed():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64, max_draft_tokens=3)
    engine.prefill(PROMPT)
    before = (engine.position, engine.state_digest())
    for bad in (0, -1, 2.5, "2", True, 4):
        with pytest.raises(InvalidArgument):
            engine.generate(5, speculative=bad)
    session = Session(engine, None)
    with pytest.raises(InvalidArgument):   # the prompt is not committed either
        session.generate([1, 2, 3], 4, speculative=9)
    assert (engine.position, engine.state_digest()) == before
    no_mtp = Engine.from_config(ModelConfig.tiny(mtp_num_hidden_layers=0), max_seq_len=64)
    no_mtp.prefill(PROMPT)
    with pytest.raises(InvalidArgument, match="MTP layer"):
        no_mtp.generate(5, speculative=1)
    assert no_mtp.position == len(PROMPT) and no_mtp.speculation_stats is None
    with pytest.raises(InvalidArgument, match="row kernel"):
        if not cpu_backend.serves(torch.device("cpu"), torch.float32):
            raise InvalidArgument("row kernel not built: nothing to refuse")
        Engine.from_config(ModelConfig.tiny(), max_seq_len=64, max_draft_tokens=8)


@needs_kernels
def test_near_max_seq_len_a_pass_drafts_fewer():
    """Two positions left: a pass may verify at most two rows, so it drafts one; then one left."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=len(PROMPT) + 30)
    plain, digests, _ = _plain(engine, PROMPT, 30)
    _known_drafts(engine, PROMPT, plain, wrong=0.0)
    engine.reset()
    engine.prefill(PROMPT)
    assert engine.generate(30, speculative=4) == plain
    assert engine.position == engine.max_seq_len
    assert engine.state_digest() == digests[engine.position]


def test_a_head_that_drafts_nothing_useful_turns_speculation_off():
    """The seeded head: drafts are rejected, so after a window of passes the engine decodes plainly."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=400)
    engine.prefill(PROMPT)
    plain = engine.generate(300)
    engine.reset()
    engine.prefill(PROMPT)
    assert engine.generate(300, speculative=2) == plain
    stats = engine.speculation_stats
    assert stats.turned_off >= 1 and stats.plain_tokens > 200 and stats.acceptance < engine.speculation.break_even


@needs_kernels
def test_distilled_head_loads_and_decodes_exactly(tmp_path):
    """flashrt-train-mtp end to end on a small budget: a head file with its metadata, loaded
    through from_config(mtp_head=...), the same tokens as plain decode."""
    from flashrt_ros.distill.train_mtp import main

    out = tmp_path / "head.safetensors"
    assert main(["tiny", "--out", str(out), "--sequences", "8", "--length", "48", "--steps", "20"]) == 0
    head, meta = mtp_head.load(out, ModelConfig.tiny())
    assert {"distilled_from", "acceptance_k1", "tokens_per_pass_k2"} <= set(meta)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=200, mtp_head=out)
    seeded = Engine.from_config(ModelConfig.tiny(), max_seq_len=200)
    assert engine.model_fingerprint != seeded.model_fingerprint   # the head is part of the model
    engine.prefill(PROMPT)
    plain = engine.generate(80)
    engine.reset()
    engine.prefill(PROMPT)
    assert engine.generate(80, speculative=2) == plain


def test_head_files_that_do_not_fit_are_refused(tmp_path):
    from flashrt_ros.errors import CheckpointError
    from flashrt_ros.runtime.weights import seeded_weights

    cfg = ModelConfig.tiny()
    head = {n: t for n, t in seeded_weights(cfg, 0).items() if n.startswith("mtp.")}
    wrong = tmp_path / "wrong.safetensors"
    mtp_head.save(wrong, head | {"mtp.fc.weight": torch.zeros(3, 3)}, {})
    with pytest.raises(CheckpointError, match="shape"):
        Engine.from_config(cfg, max_seq_len=32, mtp_head=wrong)
    partial = tmp_path / "partial.safetensors"
    mtp_head.save(partial, {"mtp.fc.weight": head["mtp.fc.weight"]}, {})
    with pytest.raises(CheckpointError, match="not an MTP head"):
        Engine.from_config(cfg, max_seq_len=32, mtp_head=partial)
    vocab = tmp_path / "vocab.safetensors"
    mtp_head.save(vocab, head | {mtp_head.DRAFT_VOCAB: torch.tensor([1, 1, 2])}, {})
    with pytest.raises(CheckpointError, match="distinct"):
        Engine.from_config(cfg, max_seq_len=32, mtp_head=vocab)


def test_the_trained_main_model_is_a_checkpoint_the_engine_loads(tmp_path):
    """flashrt_ros.distill.train_lm (make spec-model's first half) on a minimal budget."""
    from flashrt_ros.distill.train_lm import main

    assert main([str(tmp_path / "model"), "--steps", "1", "--batch", "1", "--length", "16"]) == 0
    engine = Engine.from_pretrained(tmp_path / "model", max_seq_len=64)
    assert (engine.config.vocab_size, engine.config.hidden_size, engine.config.num_hidden_layers) == (260, 512, 8)
    engine.prefill([256, *b"def "])
    assert len(engine.generate(4, speculative=2)) == 4


@needs_kernels
def test_a_pass_interrupted_between_its_commits_leaves_the_last_boundary_it_committed(monkeypatch):
    """A pass commits its tokens one boundary each; a fault after the first leaves that one live,
    with the bytes plain decode has there, not the arena of the pass's last token."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    plain, digests, _ = _plain(engine, PROMPT, 24)
    engine.reset()
    engine.prefill(PROMPT)
    _known_drafts(engine, PROMPT, plain, wrong=0.0)
    live, commits = engine._live, []
    real = live.commit

    def failing(*args, **kwargs):
        commits.append(args)
        if len(commits) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(live, "commit", failing)
    with pytest.raises(KeyboardInterrupt):
        engine.generate(8, speculative=3)
    monkeypatch.undo()
    assert engine.position == len(PROMPT) + 1
    assert engine.state_digest() == digests[engine.position]
    assert engine.generate(4) == plain[1:5]


@pytest.mark.parametrize("cpu_kernels", [pytest.param(True, marks=needs_kernels), False])
def test_the_distillers_acceptance_run_takes_a_near_tie_only_off_the_cpu_backend(monkeypatch, capsys, cpu_kernels):
    """Its verify rows are decode's bytes on the CPU backend, so a token that leaves plain
    decode's there is an error even at a tie; on torch's products (a GPU's) it is counted."""
    from flashrt_ros.distill import train_mtp
    from flashrt_ros.replay import verdicts

    monkeypatch.setattr(verdicts, "token_run", lambda scored, produced: (verdicts.TIE, "at token 3: a tie"))
    build = lambda head: Engine.from_config(ModelConfig.tiny(), max_seq_len=64, cpu_kernels=cpu_kernels)  # noqa: E731
    run = lambda: train_mtp.acceptance(build, {}, [PROMPT, PROMPT[::-1]], 8, (2,))  # noqa: E731
    if cpu_kernels:
        with pytest.raises(RuntimeError, match="with 2 drafts gave other tokens than plain decode \\(at token 3"):
            run()
        return
    assert set(run()) == {"acceptance_k2", "tokens_per_pass_k2"}
    assert "2 drafts: 2 of 2 held-out prompts left plain decode's tokens at a near-tie" in capsys.readouterr().out
