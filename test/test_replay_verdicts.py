"""Exact and portable verdicts: a platform change that alters low bits fails exact and passes
portable; a changed policy fails both; a token near a tie is a tie, and replay goes on from it."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from flashrt_ros.replay import Journal, Tolerance, judge, replay
from flashrt_ros.replay.journal import ReplayMismatch
from flashrt_ros.replay.verdicts import DIFFERS, EXACT_ONLY, SAME, TIE, WITHIN, token_run
from flashrt_ros.runtime import Engine, ModelConfig, Sampling
from flashrt_ros.runtime.backends import cpu as cpu_backend
from flashrt_ros.runtime.weights import seeded_weights
from flashrt_ros.serving.session import Session

CONFIG = ModelConfig.tiny(obs_dim=6, action_dim=4)
needs_kernels = pytest.mark.skipif(not cpu_backend.serves(torch.device("cpu"), torch.float32),
                                   reason="the CPU backend's C library is not built")


def _engine(cpu_kernels: bool = False, weights: dict | None = None) -> Engine:
    weights = weights if weights is not None else seeded_weights(CONFIG, 0)
    return Engine(CONFIG, weights, max_seq_len=256, cpu_kernels=cpu_kernels, seeded=tuple(weights))


def _record(engine: Engine) -> Journal:
    """A policy session with capsule calls and text in between, journaled by the session layer."""
    session = Session(engine, Journal())
    gen = torch.Generator().manual_seed(3)
    list(session.generate([256, 5, 9, 13, 17], 12))
    made = session.snapshot(name="goal-taken")
    for _ in range(10):
        session.step(torch.randn(CONFIG.obs_dim, generator=gen))
    session.rollback(steps=4)
    session.restore(made.info.id)
    for _ in range(6):
        session.step(torch.randn(CONFIG.obs_dim, generator=gen))
    list(session.generate([], 8, Sampling(0.9), seed=11))
    session.drop(made.info.id)
    return session.journal


@needs_kernels
def test_a_platform_change_in_the_low_bits_fails_exact_and_passes_portable():
    """The C kernels against torch's products: the same model, other summation orders."""
    journal = _record(_engine(cpu_kernels=True))
    on_torch = _engine(cpu_kernels=False)
    verdicts = judge(journal.entries, on_torch)
    assert not verdicts.exact, "the platform change must alter bytes for this test to mean anything"
    kinds = {f.what: f.portable for f in verdicts.findings}
    assert kinds.get("state_digest") == EXACT_ONLY and kinds.get("action") == WITHIN, verdicts.findings
    assert verdicts.portable and verdicts.stopped is None
    assert verdicts.entries == len(journal.entries) and verdicts.tokens == 20 and verdicts.actions == 16
    assert 0 < verdicts.largest_action_difference <= Tolerance().action_atol
    with pytest.raises(ReplayMismatch):   # the strict API stops at the first difference
        replay(journal.entries, _engine(cpu_kernels=False))
    assert judge(journal.entries, _engine(cpu_kernels=True)).exact   # and on the recording's platform


def test_a_policy_head_from_another_seed_fails_portable():
    journal = _record(_engine())
    weights = seeded_weights(CONFIG, 0)
    weights.update(seeded_weights(CONFIG, 1, names=["policy.action_head.weight"]))
    verdicts = judge(journal.entries, _engine(weights=weights))
    assert not verdicts.portable and not verdicts.exact
    failed = [f for f in verdicts.findings if f.portable == DIFFERS]
    assert failed and {f.what for f in failed} == {"action"} and len(failed) == 16, verdicts.findings
    assert all(f.what != "token" for f in verdicts.findings)   # the text side is the same model


def test_every_decode_records_the_margin_of_its_choice():
    engine = _engine()
    session = Session(engine, Journal())
    session.engine.prefill([256, 7, 7])
    logits = engine.logits()
    top = logits.topk(2).values
    list(session.generate([], 1))
    entry = session.journal.entries[-1]
    assert entry.outcome["margin"] == pytest.approx(float(top[0] - top[1]), rel=1e-6)
    list(session.generate([], 4, Sampling(0.7), seed=2))
    assert all(e.outcome["margin"] >= 0 for e in session.journal.entries if e.kind == "decode")


def _retokened(journal: Journal, seq: int, token: int, margin: float) -> list:
    """The journal as another platform might have recorded it: at ``seq`` it chose ``token``
    at ``margin``, and every later token follows from that choice."""
    entries = list(journal.entries)
    follow = _engine()
    for entry in entries[:seq]:
        if entry.kind == "prefill":
            follow.prefill(entry.request["token_ids"])
        else:
            follow.append(entry.outcome["token"])
    follow.append(token)
    changed = dataclasses.replace(entries[seq], outcome={**entries[seq].outcome, "token": token, "margin": margin})
    later = [dataclasses.replace(e, outcome={**e.outcome, "token": t})
             for e, t in zip(entries[seq + 1:], follow.generate(len(entries) - seq - 1))]
    return entries[:seq] + [changed] + later


def test_a_token_closer_to_a_tie_than_the_tolerance_is_a_tie_and_replay_goes_on_from_it():
    session = Session(_engine(), Journal())
    list(session.generate([256, 40, 41, 42], 10))
    own = session.journal.entries[4].outcome["token"]
    entries = _retokened(session.journal, 4, (own + 1) % CONFIG.vocab_size, margin=2e-4)

    verdicts = judge(entries, _engine())
    assert [(f.seq, f.what, f.portable) for f in verdicts.findings] == [(4, "token", TIE)], verdicts.findings
    assert verdicts.portable and verdicts.ties == 1 and verdicts.tokens == 10 and not verdicts.exact

    strict = judge(entries, _engine(), Tolerance(margin=1e-4))   # the same recording, a tighter tolerance
    assert not strict.portable and [f.portable for f in strict.findings] == [DIFFERS]
    unmeasured = [dataclasses.replace(e, outcome={k: v for k, v in e.outcome.items() if k != "margin"})
                  for e in entries]
    assert not judge(unmeasured, _engine()).portable   # no margin recorded: a differing token is a difference


def test_a_run_of_tokens_is_judged_at_its_first_difference_only():
    """What grows from another token is not compared: a run that leaves the scored one at a
    near-tie is a tie however it goes on, and one that leaves it elsewhere differs."""
    scored = [(5, 2.0), (7, 1e-4), (9, 3.0)]
    assert token_run(scored, [5, 7, 9]) == (SAME, "")
    outcome, detail = token_run(scored, [5, 8, 1])
    assert outcome == TIE and "at token 1" in detail and "margin 0.0001 <= tolerance 0.001" in detail
    assert token_run(scored, [5, 8, 1], Tolerance(margin=1e-5))[0] == DIFFERS
    assert token_run(scored, [6, 7, 9])[0] == DIFFERS and token_run(scored, [5, 7])[0] == DIFFERS


def test_a_changed_outcome_stops_the_replay_and_fails_both():
    journal = _record(_engine())
    entries = list(journal.entries)
    snap = next(i for i, e in enumerate(entries) if e.kind == "snapshot")
    entries[snap] = dataclasses.replace(entries[snap], outcome={**entries[snap].outcome, "error_code": 3})
    verdicts = judge(entries, _engine())
    assert verdicts.stopped is not None and verdicts.stopped.seq == entries[snap].seq
    assert not verdicts.portable and verdicts.entries == snap + 1


@pytest.mark.parametrize("bad", [{"margin": -1.0}, {"margin": float("nan")}, {"action_atol": "x"}])
def test_a_tolerance_must_be_a_finite_number_at_least_zero(bad):
    with pytest.raises(ValueError):
        Tolerance(**bad)
