"""Capsules restore the whole state byte for byte, and generation continues token for token."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.runtime import Engine, ModelConfig

PROMPT = list(b"Task context: shelf B, pick the blue box, avoid the cable. ")


def _region_bytes(engine: Engine) -> dict[str, bytes]:
    return {r.name: view.contiguous().view(torch.uint8).cpu().numpy().tobytes()
            for r, view in engine.arena.live_views(engine.position)}


def test_restore_brings_back_every_region_byte_for_byte(tiny_engine):
    tiny_engine.prefill(PROMPT)
    tiny_engine.generate(5)
    before, digest = _region_bytes(tiny_engine), tiny_engine.state_digest()
    capsule = tiny_engine.snapshot("here")
    tiny_engine.generate(20)
    tiny_engine.prefill(list(b"unrelated"))
    tiny_engine.restore(capsule)
    assert _region_bytes(tiny_engine) == before
    assert tiny_engine.state_digest() == digest == tiny_engine.capsules.get(capsule.id).digest


@pytest.mark.parametrize("tier", ["device", "host", "disk"])
def test_returning_to_a_checkpoint_rewrites_every_row_changed_since(tier, tmp_path):
    # A return copies only the rows written since the checkpoint. After a rollback below
    # it and a different continuation, those include rows the checkpoint holds itself.
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    engine.prefill(PROMPT)
    engine.generate(6)
    checkpoint = engine.snapshot(tier=tier)
    before = _region_bytes(engine)
    first = engine.generate(12)
    engine.restore(checkpoint)                     # back from a descendant
    assert _region_bytes(engine) == before
    engine.rollback(to_position=checkpoint.position - 5)
    engine.prefill(list(b"other words"))           # rows below the checkpoint now differ
    engine.restore(checkpoint)
    assert _region_bytes(engine) == before
    assert engine.generate(12) == first
    engine.restore(checkpoint, verify=True)
    assert engine.state_digest() == engine.capsules.get(checkpoint.id).digest


def test_restoring_a_capsule_that_shares_rows_with_the_live_states_ancestor_is_exact(tiny_engine):
    # Rows a capsule shares (same chunk bytes) with the capsule the live state descends from
    # are not copied: a fork of it, an earlier snapshot it extended. Rows it only shared
    # up to a rollback must still be copied.
    engine = tiny_engine
    engine.prefill(PROMPT)
    first = engine.snapshot()
    at_first = _region_bytes(engine)
    engine.generate(5)
    second = engine.snapshot()                     # extends first: shares its rows
    at_second = _region_bytes(engine)
    engine.generate(5)
    engine.restore(first)                          # the live state descends from second
    assert _region_bytes(engine) == at_first
    branch = engine.fork(first)                    # shares every byte with first
    engine.generate(3)
    engine.restore(branch)
    assert _region_bytes(engine) == at_first
    engine.restore(second)
    engine.rollback(to_position=first.position - 6)
    engine.prefill(list(b"a different turn"))      # rows below first's position now differ
    third = engine.snapshot()                      # shares only the rows before the rollback
    engine.generate(4)
    engine.restore(first)
    assert _region_bytes(engine) == at_first
    engine.restore(second)
    assert _region_bytes(engine) == at_second
    assert third.parent == second.id


def test_continuation_after_restore_is_token_identical_despite_unrelated_work(tiny_engine):
    tiny_engine.prefill(PROMPT)
    capsule = tiny_engine.snapshot()
    first = tiny_engine.generate(64)
    other = tiny_engine.snapshot("other")
    tiny_engine.prefill(list(b"something else entirely"))
    tiny_engine.generate(10)
    tiny_engine.restore(other)
    tiny_engine.generate(7)
    tiny_engine.restore(capsule)
    assert tiny_engine.generate(64) == first


def test_disk_capsule_restores_token_identically_in_a_new_engine(tmp_path):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    engine.prefill(PROMPT)
    capsule = engine.snapshot("task-start", tier="disk")
    first = engine.generate(64)
    restarted = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    assert [c.id for c in restarted.capsules.list()] == [capsule.id]
    restarted.restore("task-start", verify=True)
    assert restarted.state_digest() == capsule.digest
    assert restarted.generate(64) == first


def test_host_tier_and_verify_restore_exactly(tiny_engine):
    tiny_engine.prefill(PROMPT)
    capsule = tiny_engine.snapshot(tier="host")
    first = tiny_engine.generate(16)
    tiny_engine.restore(capsule.id, verify=True)
    assert tiny_engine.generate(16) == first


def test_kv_only_restore_diverges_because_recurrent_state_carries_meaning(tiny_engine):
    tiny_engine.prefill(PROMPT)
    capsule = tiny_engine.snapshot()
    reference = tiny_engine.generate(64)
    tiny_engine.restore(capsule)
    tiny_engine.prefill(list(b" -- a divergent continuation that rewrites the recurrent state"))
    tiny_engine.restore(capsule, regions=["kv"])
    assert tiny_engine.position == capsule.position
    assert tiny_engine.generate(64) != reference
    tiny_engine.restore(capsule)  # the full restore still works afterwards
    assert tiny_engine.generate(64) == reference


def test_an_engine_built_inside_inference_mode_snapshots_restores_forks_and_rolls_back():
    # Its arena and capsule pool are inference tensors, which refuse in-place writes
    # outside inference mode: every capsule operation must run inside it.
    with torch.inference_mode():
        engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(PROMPT)
    capsule = engine.snapshot()
    first = engine.generate(8)
    branch = engine.fork(capsule)
    engine.rollback(steps=3)
    engine.restore(capsule, regions=["kv"])
    engine.restore(branch, verify=True)
    assert engine.state_digest() == engine.capsules.get(capsule.id).digest
    assert engine.generate(8) == first
