"""Forks share their parent's KV prefix: branches are independent, exact, and cost about P + N * delta."""
from __future__ import annotations

import torch

from flashrt_ros.capsule.store import SHARE_PIECES
from flashrt_ros.runtime import Engine, ModelConfig


def test_two_branches_from_one_capsule_evolve_independently_and_restore_exactly(tiny_engine):
    tiny_engine.prefill(list(range(40)))
    root = tiny_engine.snapshot("root")
    left = tiny_engine.fork(root, "left")
    right = tiny_engine.fork(root, "right")
    assert left.parent == right.parent == root.id and left.nbytes == 0

    tiny_engine.restore(left)
    tiny_engine.prefill([1, 2, 3])
    left_tokens = tiny_engine.generate(12)
    left_end = tiny_engine.snapshot("left-end")
    tiny_engine.restore(right)
    tiny_engine.prefill([9, 8, 7])
    right_tokens = tiny_engine.generate(12)
    right_end = tiny_engine.snapshot("right-end")
    assert left_tokens != right_tokens

    tiny_engine.restore(left_end)
    assert tiny_engine.state_digest() == tiny_engine.capsules.get(left_end.id).digest
    after_left = tiny_engine.generate(8)
    tiny_engine.restore(right_end)
    assert tiny_engine.state_digest() == tiny_engine.capsules.get(right_end.id).digest
    tiny_engine.restore(left_end)
    assert tiny_engine.generate(8) == after_left


def test_n_branches_of_a_long_prefix_cost_about_one_prefix():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=2048)
    prefix, delta, branches = 1500, 16, 6
    engine.prefill([i % 250 for i in range(prefix)])
    root = engine.snapshot("prefix")
    one_prefix = engine.capsules.used_bytes("device")
    assert root.nbytes == one_prefix
    for i in range(branches):
        engine.restore(root)
        engine.prefill([(i * 7 + j) % 250 for j in range(delta)])
        engine.fork(name=f"branch-{i}")
    used = engine.capsules.used_bytes("device")
    rows = sum(r.row_bytes for r in engine.arena.regions if r.per_token)
    per_branch = engine.arena.fixed_bytes + delta * rows
    assert used <= one_prefix + branches * per_branch + branches * 256  # alignment slack only
    full_copies = branches * (engine.arena.fixed_bytes + (prefix + delta) * rows)
    assert used < 0.25 * (one_prefix + full_copies)


def test_a_long_chain_of_snapshots_stays_in_few_pieces_and_each_restores_exactly():
    """A snapshot per step, each extending the last: the rows are shared until the base lies in
    SHARE_PIECES pieces, then copied whole, so no capsule's piece list (and no snapshot's
    slicing) grows with the chain. Every capsule still holds its own state."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(list(range(1, 9)))
    per_token = sum(r.per_token for r in engine.arena.regions)
    taken, states = [], []
    for _ in range(3 * SHARE_PIECES // per_token):   # past the bound twice
        taken.append(engine.snapshot())
        states.append(engine.arena.buffer.clone())
        engine.generate(1)
    pieces = [len(engine.capsules.resolve(info).pieces) for info in taken]
    assert max(pieces) <= SHARE_PIECES + per_token + 1
    assert pieces.count(pieces[0]) >= 2, "the chain starts over: some capsules are whole copies again"
    layout = engine.capsules.layout
    rows_copied = sum(info.nbytes - layout.fixed_bytes for info in taken)
    assert rows_copied < sum(info.position * layout.row_bytes for info in taken) / 4, "most rows are still shared"
    for info, state in list(zip(taken, states))[::7]:
        engine.restore(info)
        live = engine.capsules.layout.ranges(info.position)
        assert all(torch.equal(engine.arena.buffer[s:e], state[s:e]) for s, e in live)
        assert engine.state_digest() == engine.capsules.get(info.id).digest
