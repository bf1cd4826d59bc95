"""The agent-resume ablation on the trained data/spec_tiny: a full restore and a recompute give
the uninterrupted tokens back, and each restore writes exactly the groups it names."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.bench.agent_resume import MODES, Sizes, contexts, draw, held_out_files, run
from flashrt_ros.resources import package_file
from flashrt_ros.runtime import Engine

SMALL = Sizes(context=512, side=64, answer=32, resumed=32, cue=16, max_seq_len=1024)


@pytest.fixture(scope="module")
def result():
    return run(3, SMALL)


def test_full_restore_and_recompute_resume_the_uninterrupted_tokens_exactly(result):
    for outcome in result.outcomes:
        for mode in ("full", "recompute"):
            assert outcome[mode].first_diff is None and outcome[mode].matches == SMALL.resumed, mode
            assert outcome[mode].same_state, mode


def test_restoring_all_but_the_kv_equals_a_full_restore_while_the_context_only_grows(result):
    # The side request is appended after the interruption: it never rewrites KV rows below it.
    for outcome in result.outcomes:
        assert outcome["no_kv"].same_state and outcome["no_kv"].first_diff is None


def test_every_mode_has_a_row_and_the_table_and_chart_are_made(result, tmp_path):
    assert [r["mode"] for r in result.rows] == list(MODES)
    assert all(r["contexts"] == 3 for r in result.rows)
    assert next(r for r in result.rows if r["mode"] == "continue")["resume_ms"] == 0
    text = result.table()
    assert all(label in text for label in MODES.values())
    assert draw(result, tmp_path / "agent_resume.png").stat().st_size > 0


def test_a_kv_only_restore_writes_the_kv_rows_and_position_and_nothing_else():
    ctx = contexts(1, SMALL)[0]
    with Engine.from_pretrained(package_file("data/spec_tiny"), max_seq_len=SMALL.max_seq_len) as engine:
        views = engine.arena.views
        engine.prefill(ctx.tokens)
        capsule = engine.snapshot()
        at_snapshot = {name: view.clone() for name, view in views.items()}
        engine.prefill(ctx.side)
        engine.generate(SMALL.answer)
        interrupted = {name: view.clone() for name, view in views.items()}
        engine.restore(capsule, regions=["kv"])
        p = capsule.position
        assert engine.position == p and int(views["meta.position"][0]) == p
        assert torch.equal(views["kv"][:p], at_snapshot["kv"][:p])
        for name in views.keys() - {"kv", "meta.position"}:
            assert torch.equal(views[name], interrupted[name]), name
        engine.restore(capsule)
        assert engine.state_digest() == engine.capsules.get(capsule.id).digest


def test_contexts_are_held_out_text_and_no_side_request_is_another_contexts():
    picked = contexts(4, SMALL)
    assert len({c.name for c in picked}) == 4 and all("/" in c.name for c in picked)   # sub-packages only
    assert all(len(c.tokens) == SMALL.context and len(c.side) == SMALL.side for c in picked)
    assert not {tuple(c.side[2:]) for c in picked} & {tuple(c.tokens[1:SMALL.side - 1]) for c in picked}
    assert len(held_out_files(SMALL.context)) >= 8


def test_sizes_that_do_not_fit_the_kv_are_refused():
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        Sizes(context=4000, max_seq_len=4096)
