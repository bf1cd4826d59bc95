"""Forks share their parent's KV prefix: branches are independent, exact, and cost about P + N * delta."""
from __future__ import annotations

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
