"""The digest worker posts what it hashed; the store collects it under its own lock, and a capsule
that leaves the store takes its job with it."""
from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from flashrt_ros.capsule import digest_worker
from flashrt_ros.runtime import Engine, ModelConfig

HANG_S = 30   # a bound on a wait that must end at once, for a failure to show instead of hanging


class Gate:
    """Stands in for ``digest_worker.hashed``: the worker (not a caller hashing a job itself)
    stops inside it until ``open``."""

    def __init__(self) -> None:
        self.entered, self.opened = threading.Event(), threading.Event()
        self._hashed = digest_worker.hashed

    def __call__(self, layout, job):
        if threading.current_thread().name == "capsule-digest":
            self.entered.set()
            assert self.opened.wait(HANG_S), "the gate was never opened"
        return self._hashed(layout, job)

    def open(self) -> None:
        self.opened.set()


@pytest.fixture
def gate(monkeypatch) -> Gate:
    gate = Gate()
    monkeypatch.setattr(digest_worker, "hashed", gate)
    yield gate
    gate.open()


def _engine() -> Engine:
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(list(range(1, 30)))
    return engine


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def _counted(engine: Engine) -> dict[str, int]:
    """What each tier counts, and what the capsules in it hold (chunks once each)."""
    store = engine.capsules
    chunks = {id(p.chunk): p.chunk for c in store.list() for p in store.resolve(c.id).pieces}
    return {tier: (store.used_bytes(tier), sum(c.nbytes for c in chunks.values() if c.tier == tier))
            for tier in ("device", "host")}


def test_a_posted_digest_reaches_its_capsule_only_when_the_store_collects_it_and_is_final():
    engine = _engine()
    store = engine.capsules
    info = engine.snapshot()
    record = store.resolve(info.id)
    store.start_digests()
    _until(lambda: store.digests.posted, "the worker posted the digest")
    # Posted, not collected: the worker changed nothing of the capsule.
    assert record.info.digest == "" and record.job is not None
    listed = {c.id: c for c in store.list()}                # entering the store collects it
    assert listed[info.id].digest == engine.state_digest() and record.job is None
    assert [(kind, i.digest) for kind, i in store.take_events()] == [
        ("snapshot", ""), ("digest", engine.state_digest())]
    assert store.get(info.id) == listed[info.id]           # final: nothing is hashed again
    store.verify(record)


def test_get_waits_for_the_hash_the_worker_is_running(gate):
    engine = _engine()
    info = engine.snapshot()
    engine.capsules.start_digests()
    assert gate.entered.wait(HANG_S)
    got = {}
    reader = threading.Thread(target=lambda: got.update(info=engine.capsules.get(info.id)))
    reader.start()
    gate.open()
    reader.join(HANG_S)
    assert got["info"].digest == engine.state_digest()


def test_a_capsule_dropped_while_its_job_runs_leaves_exact_bytes_and_no_digest(gate):
    engine = _engine()
    store = engine.capsules
    running = engine.snapshot(tier="host")
    engine.capsules.start_digests()
    assert gate.entered.wait(HANG_S)                      # the worker is hashing "running"
    engine.reset()
    engine.prefill(list(range(2, 31)))                    # shares no bytes with "running"
    kept = engine.snapshot(tier="host")
    dropping = threading.Thread(target=store.drop, args=(running.id,))
    dropping.start()                                      # waits for that one hash, under the lock
    gate.open()
    dropping.join(HANG_S)
    assert not dropping.is_alive()
    assert store.used_bytes("host") == kept.nbytes
    assert _counted(engine) == {"device": (0, 0), "host": (kept.nbytes, kept.nbytes)}
    assert [c.id for c in store.list()] == [kept.id]
    assert ("digest", running.id) not in [(kind, i.id) for kind, i in store.take_events()]


def test_a_capsule_dropped_while_its_job_is_queued_leaves_exact_bytes_and_is_never_hashed(gate):
    engine = _engine()
    store = engine.capsules
    first = engine.snapshot(tier="host")
    engine.capsules.start_digests()
    assert gate.entered.wait(HANG_S)                      # the worker holds "first": the next job waits
    engine.prefill([7])
    queued = engine.snapshot(tier="host")
    store.drop(queued.id)                                 # taken back from the queue, at once
    assert store.used_bytes("host") == first.nbytes
    assert _counted(engine) == {"device": (0, 0), "host": (first.nbytes, first.nbytes)}
    gate.open()
    assert store.get(first.id).digest != ""
    assert [i.id for kind, i in store.take_events() if kind == "digest"] == [first.id]


def test_a_spill_finishes_the_digest_of_the_capsule_it_moves_from_the_bytes_it_had():
    size = _engine().snapshot().nbytes
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128, spill=True,
                                budgets={"device": size + 256, "host": 1 << 20})
    engine.capsules.digests.close()                       # no worker: the job stays queued
    engine.prefill(list(range(1, 30)))
    first = engine.snapshot()
    live = engine.state_digest()
    engine.reset()
    engine.prefill(list(range(2, 31)))                    # as long, other bytes, nothing shared
    engine.snapshot()                                     # moves "first" to host
    moved = engine.capsules.get(first.id, wait=False)
    assert (moved.tier, moved.digest) == ("host", live)
    engine.restore(first.id, verify=True)


def test_a_store_dropped_with_jobs_pending_keeps_none_of_their_memory(gate):
    engine = _engine()
    infos = [engine.snapshot(tier="host")]
    engine.capsules.start_digests()
    assert gate.entered.wait(HANG_S)                      # one job running, the others queued
    for token in (5, 6):
        engine.prefill([token])
        infos.append(engine.snapshot(tier="host"))
    buffers = [weakref.ref(engine.capsules.resolve(i.id).pieces[0].chunk.data) for i in infos]
    store, worker = weakref.ref(engine.capsules), engine.capsules.digests
    del engine
    gc.collect()
    assert store() is None, "the worker (or anything else) keeps a dropped store alive"
    assert [b() is None for b in buffers[1:]] == [True, True], "queued jobs outlive their store"
    gate.open()                                           # the running hash ends; nothing is posted
    worker._thread.join(HANG_S)
    assert not worker.alive and not worker.posted
    assert buffers[0]() is None


def test_close_ends_the_worker_mid_hash_even_with_the_lock_held(gate):
    engine = _engine()
    engine.snapshot(tier="host")
    engine.capsules.start_digests()
    assert gate.entered.wait(HANG_S)
    engine.snapshot(tier="host")                          # queued behind it
    closing = threading.Thread(target=lambda: (engine.lock.acquire(), engine.capsules.close(), engine.lock.release()))
    closing.start()
    gate.open()
    closing.join(HANG_S)
    assert not closing.is_alive() and not engine.capsules.digests.alive
    assert engine.capsules.used_bytes("host") == 0 and engine.capsules.list() == []
