"""Snapshot and restore as plans the store makes and the engine carries out: exact bytes, and a
plan interrupted part-way keeps nothing it should not."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.capsule import plans
from flashrt_ros.capsule.errors import CorruptCapsule
from flashrt_ros.runtime import Engine, ModelConfig


def test_a_return_copies_the_fixed_state_and_the_new_rows_and_a_full_restore_all_of_it():
    ids = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(2))
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(ids)
    held = engine.snapshot()
    at_snapshot = engine.arena.buffer.clone()
    engine.generate(5)
    record = engine.capsules.resolve(held)
    plan = engine.capsules.plan_restore(record, keep_rows=held.position)
    assert sum(end - start for start, end, _ in plan.copies) == engine.arena.fixed_bytes
    engine.restore(held)                      # a return: the fixed-size state only
    fixed = engine.arena.fixed_bytes
    assert torch.equal(engine.arena.buffer[:fixed], at_snapshot[:fixed])
    assert engine.state_digest() == engine.capsules.get(held.id).digest
    engine.reset()
    engine.restore(held)                      # a full restore
    assert engine.state_digest() == engine.capsules.get(held.id).digest
    engine.close()


def test_a_snapshot_interrupted_in_its_copy_keeps_no_bytes_and_no_capsule(monkeypatch):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    store = engine.capsules
    used, largest = store.used_bytes("device"), store.pool.largest_free()
    real = plans.SnapshotPlan.copy

    def interrupted(self, buffer):
        real(self, buffer)
        raise KeyboardInterrupt

    monkeypatch.setattr(plans.SnapshotPlan, "copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.snapshot(name="cut")
    monkeypatch.undo()
    assert store.used_bytes("device") == used and store.pool.largest_free() == largest and store.list() == []
    assert engine.snapshot(name="cut").position == 3   # the name was never taken
    engine.close()


def test_a_snapshot_whose_bookkeeping_fails_keeps_no_bytes(monkeypatch):
    from flashrt_ros.capsule import store as store_module

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    store = engine.capsules
    used, largest = store.used_bytes("device"), store.pool.largest_free()

    def no_id(nbytes: int) -> str:
        raise RuntimeError("no id")

    monkeypatch.setattr(store_module.secrets, "token_hex", no_id)
    with pytest.raises(RuntimeError, match="no id"):
        engine.snapshot()
    assert store.used_bytes("device") == used and store.pool.largest_free() == largest and store.list() == []
    engine.close()


def test_a_restore_interrupted_in_its_copy_leaves_the_next_restore_exact(monkeypatch):
    """The arena holds part of the new bytes: the next restore must copy every row instead of
    trusting those of the capsule the state last came from, and the ring names no boundary."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill(list(range(1, 9)))
    engine.snapshot(name="s")
    engine.generate(4)
    engine.snapshot(name="b")
    engine.restore("s")
    engine.prefill([40, 41, 42, 43])       # another continuation of s
    a = engine.snapshot(name="a")
    lineage = engine.lineage
    real = plans.RestorePlan.copy

    def interrupted(self, buffer):
        self.copies = self.copies[:1]   # the first range lands, then the Ctrl-C
        real(self, buffer)
        raise KeyboardInterrupt

    monkeypatch.setattr(plans.RestorePlan, "copy", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.restore("b")
    monkeypatch.undo()
    assert engine.lineage == lineage + 1   # a stream extending the old state stops
    engine.restore("a")
    assert engine.state_digest() == engine.capsules.get(a.id).digest
    assert engine.rollback(0) == a.position
    engine.close()


def test_a_verified_restore_that_lands_other_bytes_puts_the_live_state_back(monkeypatch):
    """The capsule's stored bytes verify, but the arena after the copy does not match its digest
    (a copy gone wrong): CorruptCapsule, and the state before the restore, bytes and boundary."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill(list(range(1, 9)))
    held = engine.snapshot()
    engine.generate(4)
    before, position, lineage = engine.state_digest(), engine.position, engine.lineage
    real = plans.RestorePlan.copy

    def landed_wrong(self, buffer):
        real(self, buffer)
        buffer[0] += 1   # a byte of the fixed-size block, which every restore copies

    monkeypatch.setattr(plans.RestorePlan, "copy", landed_wrong)
    with pytest.raises(CorruptCapsule, match=held.id):
        engine.restore(held, verify=True)
    monkeypatch.undo()
    assert engine.state_digest() == before and engine.position == position and engine.lineage == lineage
    assert engine.rollback(4) == held.position   # the ring still holds the boundaries before it
    engine.close()


def test_a_host_capsule_is_the_live_state_byte_for_byte():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill(list(range(1, 20)))
    live = engine.state_digest()
    host = engine.snapshot(tier="host")
    engine.generate(5)
    assert engine.capsules.get(host.id).digest == live
    engine.restore(host, verify=True)
    assert engine.state_digest() == live
    engine.close()
