"""Tiers and budgets: LRU spill down a tier or refuse, pinned capsules stay, every move is announced."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.capsule import BudgetExceeded
from flashrt_ros.capsule.pieces import chunks_of as _chunks
from flashrt_ros.errors import ErrorCode
from flashrt_ros.runtime import Engine, ModelConfig


def _taker(store, shape=lambda kind, info: (kind, info.id, info.tier)):
    """``events()``: every event the store has raised so far, as ``shape`` gives them."""
    seen = []

    def events() -> list:
        seen.extend(shape(kind, info) for kind, info in store.take_events())
        return seen
    return events


def _engine(tmp_path, spill: bool, capsules: int = 2):
    probe = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    probe.prefill(list(range(50)))
    size = probe.snapshot().nbytes
    budgets = {"device": capsules * (size + 256), "host": capsules * size, "disk": 100 * size}
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128, budgets=budgets, spill=spill,
                                capsule_dir=tmp_path)
    engine.prefill(list(range(50)))
    return engine, _taker(engine.capsules)


def _fresh_snapshot(engine, name, pin=False):
    engine.reset()
    engine.prefill(list(range(50)))   # no shared prefix: every capsule is full size
    return engine.snapshot(name, pin=pin)


def test_spill_moves_the_least_recently_used_capsule_down_a_tier(tmp_path):
    engine, events = _engine(tmp_path, spill=True)
    first = _fresh_snapshot(engine, "first")
    second = _fresh_snapshot(engine, "second")
    third = _fresh_snapshot(engine, "third")
    tiers = {c.name: c.tier for c in engine.capsules.list()}
    assert tiers == {"first": "host", "second": "device", "third": "device"}
    assert ("spill", first.id, "host") in events()
    for _ in range(2):
        _fresh_snapshot(engine, None)
    assert {c.name: c.tier for c in engine.capsules.list()}["first"] == "disk"
    engine.restore("first")           # restorable from any tier, and exact
    assert engine.state_digest() == engine.capsules.get(first.id).digest
    assert second.id and third.id


def test_a_restored_then_spilled_capsule_restores_its_own_bytes_not_the_reused_pool_memory(tmp_path):
    engine, _ = _engine(tmp_path, spill=True)

    def fresh(k: int):
        engine.reset()
        engine.prefill([(t + 7 * k) % 100 for t in range(50)])   # same size, different bytes
        return engine.snapshot(f"c{k}")
    first = fresh(0)
    want = engine.capsules.get(first.id).digest
    engine.restore(first)             # its copy plan now points into the device pool
    for k in (1, 2):
        fresh(k)                      # the pool is full: first moves to host, its pool bytes are reused
    assert engine.capsules.get(first.id).tier == "host"
    engine.reset()
    engine.restore(first)
    assert engine.state_digest() == want


def test_without_spill_a_full_tier_refuses_and_keeps_every_capsule(tmp_path):
    engine, events = _engine(tmp_path, spill=False)
    _fresh_snapshot(engine, "a")
    _fresh_snapshot(engine, "b")
    before = engine.state_digest()
    with pytest.raises(BudgetExceeded) as info:
        engine.snapshot("c")
    assert info.value.code == ErrorCode.BUDGET_EXCEEDED and "spill is off" in str(info.value)
    assert sorted(c.name for c in engine.capsules.list()) == ["a", "b"]
    assert engine.state_digest() == before
    assert not [e for e in events() if e[0] in ("spill", "evict")]


def test_pinned_capsules_are_never_evicted(tmp_path):
    engine, _ = _engine(tmp_path, spill=True)
    pinned = _fresh_snapshot(engine, "keep", pin=True)
    for i in range(4):
        _fresh_snapshot(engine, f"n{i}")
    assert engine.capsules.get(pinned.id).tier == "device"


def test_drop_frees_the_bytes_and_list_get_find_by_id_or_name(tmp_path):
    engine, events = _engine(tmp_path, spill=True)
    capsule = engine.snapshot("named")
    assert engine.capsules.get("named").id == capsule.id == engine.capsules.get(capsule.id).id
    assert engine.capsules.used_bytes("device") == capsule.nbytes
    assert engine.capsules.budget_bytes("device") > 0
    engine.capsules.drop("named")
    assert engine.capsules.list() == [] and engine.capsules.used_bytes("device") == 0
    # get() made the digest final, which announced it.
    assert [e[0] for e in events()] == ["snapshot", "digest", "drop"]


def test_the_final_digest_is_announced_once_hashed_and_not_for_a_capsule_dropped_before(tmp_path):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(list(range(1, 20)))
    gone = engine.snapshot("gone")
    assert gone.digest == "" and gone.history_hash == ""   # pending: the snapshot did not wait
    engine.capsules.drop(gone.id)                          # hashed or not, its job goes with it
    kept = engine.snapshot("kept")
    final = engine.capsules.get(kept.id)
    assert final.digest and final.history_hash
    digests = [info for kind, info in engine.capsules.take_events() if kind == "digest"]
    assert [(i.id, i.digest, i.history_hash) for i in digests] == [(kept.id, final.digest, final.history_hash)]


def test_a_digest_is_announced_with_the_final_info_whether_the_worker_or_the_caller_hashed_it():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(list(range(1, 20)))
    first = engine.snapshot("worker")
    assert _digest_without_waiting(engine, first.id), "the digest worker never posted its result"
    assert engine.lock.acquire(timeout=5)       # and nothing kept the engine's lock
    engine.lock.release()
    engine.capsules.digests.close()             # no worker: the next digest is hashed in this thread
    second = engine.snapshot("caller")
    final = engine.capsules.get(second.id)
    seen = [(info.id, info.digest) for kind, info in engine.capsules.take_events() if kind == "digest"]
    assert seen == [(first.id, engine.capsules.get(first.id).digest), (second.id, final.digest)]
    assert final.digest == engine.state_digest()


def test_a_capsule_dropped_on_its_digest_event_after_a_spill_finished_that_digest_loses_nothing(tmp_path):
    """Spilling "first" to make room for "second" finishes its digest in this thread. The
    owner takes the events once the snapshot is over, and drops a capsule whole on host."""
    engine, events = _engine(tmp_path, spill=True, capsules=1)
    # No digest worker: else it may hash "first" itself, and the spill only collects it.
    # Now the spill finishes the digest and announces it.
    engine.capsules.digests.close()
    first = {"id": _fresh_snapshot(engine, "first").id}
    second = _fresh_snapshot(engine, "second")
    for kind, cid, _ in list(events()):
        if kind == "digest" and cid == first["id"]:
            engine.capsules.drop(cid)
    assert [(c.name, c.tier) for c in engine.capsules.list()] == [("second", "device")]
    kinds = [(kind, tier) for kind, cid, tier in events() if cid == first["id"]]
    assert kinds == [("snapshot", "device"), ("digest", "device"), ("spill", "host"), ("drop", "host")]
    assert engine.capsules.used_bytes("host") == 0
    engine.reset()
    engine.restore(second.id, verify=True)


def test_a_capsule_dropped_on_the_spill_event_of_another_frees_nothing_twice(tmp_path):
    """B moves to host, which first pushes A to disk; on A's spill event the owner drops B.
    A drop in the middle of that move released B's device chunk twice: the fork F that
    shares it lost its bytes to the next snapshot. Events are taken once the move is over."""
    engine, events = _engine(tmp_path, spill=True, capsules=1)
    store, ids = engine.capsules, {}
    ids["a"] = store.get(_fresh_snapshot(engine, "a").id).id          # device, then host
    ids["b"] = store.get(_fresh_snapshot(engine, "b").id).id          # device; a to host
    fork = engine.fork(ids["b"], "f")
    store.resolve("f").last_used = float("inf")                     # b is the one to spill next
    engine.reset()
    engine.prefill([(t * 7 + 3) % 100 for t in range(50)])
    c = engine.snapshot("c")                                        # b down the tiers, f to host
    assert ("spill", ids["a"], "disk") in events()
    store.drop(ids["b"])
    assert ids["b"] not in [c.id for c in store.list()]
    order = [(kind, cid) for kind, cid, _ in events()]
    assert order.index(("drop", ids["b"])) > order.index(("snapshot", c.id))   # after the whole move
    assert store.used_bytes("host") == sum(c.nbytes for c in store.list("host"))
    assert store.used_bytes("disk") == sum(c.nbytes for c in store.list("disk"))
    store.verify(store.resolve(fork.id))                            # its bytes are its own still
    engine.reset()
    engine.restore(fork.id, verify=True)


def test_events_are_taken_once_each_in_the_order_they_happened(tmp_path):
    engine, _ = _engine(tmp_path, spill=True, capsules=1)
    first = _fresh_snapshot(engine, "first")
    second = _fresh_snapshot(engine, "second")   # spills "first"
    events = [(kind, info.id) for kind, info in engine.capsules.take_events() if kind != "digest"]
    assert events == [("snapshot", first.id), ("spill", first.id), ("snapshot", second.id)]
    assert events[-1][0] == "snapshot" and events[-1][1] == engine.capsules.get("second").id
    assert [kind for kind, _ in engine.capsules.take_events()] in ([], ["digest"])   # nothing twice


def test_an_owner_that_never_takes_the_events_keeps_only_the_latest():
    from flashrt_ros.capsule.store import EVENTS_KEPT

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill([1, 2, 3])
    for _ in range(EVENTS_KEPT // 2 + 1):   # a snapshot and a drop each
        engine.capsules.drop(engine.snapshot().id)
    last = engine.snapshot()
    events = engine.capsules.take_events()
    assert len(events) <= EVENTS_KEPT and events[-1] == ("snapshot", last)


def test_no_digest_event_follows_the_drop_of_its_capsule():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    events = _taker(engine.capsules, lambda kind, info: (kind, info.id))
    engine.prefill(list(range(1, 20)))
    for _ in range(60):   # the digest worker hashes while this thread drops: a race, run many times
        capsule = engine.snapshot()
        engine.prefill([5])
        engine.capsules.drop(capsule.id)
        events()
    engine.capsules.get(engine.snapshot().id)   # the queue is drained past every dropped capsule
    dropped_at = {cid: i for i, (kind, cid) in enumerate(events()) if kind == "drop"}
    late = [cid for i, (kind, cid) in enumerate(events()) if kind == "digest" and i > dropped_at.get(cid, i)]
    assert len(dropped_at) == 60 and late == []


def test_a_fork_of_a_hashed_capsule_takes_its_digest_and_one_of_a_pending_capsule_is_hashed(tmp_path):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128, capsule_dir=tmp_path)
    events = _taker(engine.capsules, lambda kind, info: (kind, info.id))
    engine.prefill(list(range(1, 20)))
    source = engine.capsules.get(engine.snapshot("source").id)       # waits: hashed
    fork = engine.fork(source.id)
    assert (fork.digest, fork.history_hash) == (source.digest, source.history_hash) != ("", "")
    assert ("digest", fork.id) not in events()                        # nothing was queued for it
    assert engine.capsules.resolve(fork.id).job is None
    on_disk = engine.snapshot("on-disk", tier="disk")                 # a disk capsule's digest is final
    from_disk = engine.fork(on_disk.id)
    assert from_disk.digest == on_disk.digest != "" and from_disk.tier == "host"
    pending = engine.snapshot("pending")
    late = engine.fork(pending.id)
    assert late.digest == ""                                          # its source is not hashed yet
    assert engine.capsules.get(late.id).digest == engine.capsules.get(pending.id).digest != ""
    # The digests taken over are those of the bytes: each restores and verifies.
    for info in (fork, from_disk, late):
        engine.restore(info.id, verify=True)
        assert engine.state_digest() == engine.capsules.get(info.id).digest
    for info in engine.capsules.list():                               # every hold released on drop
        engine.capsules.drop(info.id)
    assert engine.capsules.used_bytes("device") == engine.capsules.used_bytes("host") == 0


def test_shared_prefix_bytes_stay_until_the_last_capsule_using_them_is_dropped(tiny_engine):
    tiny_engine.prefill(list(range(60)))
    root = tiny_engine.snapshot("root")
    tiny_engine.generate(4)
    child = tiny_engine.snapshot("child")
    tiny_engine.capsules.drop(root)
    tiny_engine.prefill([1])
    tiny_engine.restore(child, verify=True)    # still complete without its parent
    assert tiny_engine.capsules.used_bytes("device") == root.nbytes + child.nbytes
    tiny_engine.capsules.drop(child)
    assert tiny_engine.capsules.used_bytes("device") == 0


def _exported_bytes(engine, capsule_id: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """The capsule's data as ``export`` gives it, as the store's pieces hold it, and whether
    the first is a view of the capsule's own memory."""
    store = engine.capsules
    _, _, data = store.export(capsule_id)
    held = store.resolve(capsule_id)
    pieces = [p.view() for s, e in store.layout.ranges(held.info.position) for p in held.pieces_in(s, e)]
    return data, torch.cat(pieces), data.data_ptr() == pieces[0].data_ptr()


def test_export_views_a_host_capsule_in_one_chunk_and_copies_pool_and_shared_bytes(tiny_engine):
    tiny_engine.prefill(list(range(60)))
    root = tiny_engine.snapshot("root", tier="host")
    data, held, viewed = _exported_bytes(tiny_engine, root.id)
    assert torch.equal(data, held) and viewed   # the capsule's own bytes
    tiny_engine.capsules.drop(root)
    for _ in range(3):   # new capsules take new host memory, never the dropped one's
        tiny_engine.prefill([7, 8])
        tiny_engine.snapshot(tier="host")
    assert torch.equal(data, held)   # ``held`` is a copy made before the drop
    pooled = tiny_engine.snapshot("pooled", tier="device")
    data, held, viewed = _exported_bytes(tiny_engine, pooled.id)
    assert torch.equal(data, held) and not viewed   # the pool hands its bytes out again
    base = tiny_engine.snapshot("base", tier="host")
    tiny_engine.generate(4)
    child = tiny_engine.snapshot("child", tier="host")
    assert len({id(p.chunk) for p in tiny_engine.capsules.resolve(child.id).pieces}) > 1   # rows shared with base
    data, held, viewed = _exported_bytes(tiny_engine, child.id)
    assert torch.equal(data, held) and not viewed
    assert tiny_engine.capsules.get(base.id).digest   # the base untouched


def _digest_without_waiting(engine, capsule_id: str, timeout: float = 10.0) -> str:
    """The digest as the background thread leaves it, polled without ever asking for it."""
    import time

    deadline = time.monotonic() + timeout
    while engine.capsules.get(capsule_id, wait=False).digest == "" and time.monotonic() < deadline:
        time.sleep(0.01)
    return engine.capsules.get(capsule_id, wait=False).digest


def test_a_snapshot_is_hashed_in_the_background_while_the_engine_stays_idle(tiny_engine):
    """A snapshot does not wake the digest thread (that would slow the call down); the
    next step does, and with no next step the thread's poll finds the job."""
    engine = tiny_engine
    engine.prefill(list(range(1, 40)))
    live = engine.state_digest()
    assert _digest_without_waiting(engine, engine.snapshot().id) == live
    second = engine.snapshot()
    engine.generate(1)
    assert _digest_without_waiting(engine, second.id) == live


def test_a_dropped_capsule_leaves_no_memory_behind_hashed_or_not(tiny_engine):
    """Bytes a tier no longer counts must really be free: neither the record's digest job
    nor an idle digest thread may keep a dropped capsule's host buffer alive."""
    import gc
    import weakref

    engine = tiny_engine
    engine.prefill(list(range(1, 200)))
    for hashed in (False, True):
        info = engine.snapshot(tier="host")
        if hashed:
            engine.capsules.get(info.id)
        buffer = weakref.ref(engine.capsules.resolve(info.id).pieces[0].chunk.data)
        engine.capsules.drop(info.id)
        gc.collect()
        assert engine.capsules.used_bytes("host") == 0
        assert buffer() is None, f"a dropped capsule's buffer is still alive (hashed before the drop: {hashed})"


def test_get_is_one_step_against_a_concurrent_drop(tiny_engine):
    """get(wait=True) either returns the final digest or says the capsule is gone; a drop
    between its lookup and its wait once made it return a cancelled job's empty digest."""
    import threading
    import time

    engine = tiny_engine
    engine.prefill(list(range(1, 40)))
    store = engine.capsules
    info = engine.snapshot()
    lookup = store.resolve

    def slow_lookup(ref):   # widens the window that a drop from another thread can fall into
        found = lookup(ref)
        time.sleep(0.05)
        return found

    store.resolve = slow_lookup
    got = {}
    reader = threading.Thread(target=lambda: got.update(info=store.get(info.id)))
    reader.start()
    time.sleep(0.01)
    store.resolve = lookup
    store.drop(info.id)
    reader.join(10)
    assert got["info"].digest == engine.state_digest()


def test_a_capsule_dropped_before_its_digest_frees_everything_and_logs_nothing(tiny_engine, caplog):
    """The digest thread holds the pieces it was given; a drop meanwhile must not make
    it read nothing (a spurious CorruptCapsule) or keep the chunks forever."""
    engine = tiny_engine
    engine.prefill(list(range(1, 40)))
    base = engine.snapshot(name="base")
    engine.capsules.get(base.id)
    used = engine.capsules.used_bytes("device")
    for _ in range(50):
        engine.restore(base.id)
        engine.capsules.drop(engine.snapshot().id)  # before its digest is done, most of the time
    last = engine.snapshot()
    engine.capsules.get(last.id)                    # the queue has drained up to here
    engine.capsules.drop(last.id)
    assert engine.capsules.used_bytes("device") == used
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "WARNING")], caplog.text


def test_close_releases_every_capsule_and_stops_the_digest_thread(tiny_engine):
    engine = tiny_engine
    engine.prefill(list(range(1, 30)))
    for tier in ("device", "host", "device"):
        engine.snapshot(tier=tier)
    assert engine.capsules.used_bytes("device") > 0
    engine.close()
    assert engine.capsules.used_bytes("device") == 0 and engine.capsules.used_bytes("host") == 0
    assert engine.capsules.list() == [] and not engine.capsules.digests.alive


def test_waiting_for_a_digest_while_holding_the_lock_cannot_deadlock(tiny_engine):
    """The worker finishes A and waits for the lock to settle it; the lock holder needs
    B's digest, queued behind A. B is hashed in the holder's thread instead."""
    import threading

    engine = tiny_engine
    engine.prefill(list(range(1, 60)))
    done = threading.Event()

    def holder():
        with engine.lock:
            engine.snapshot()                          # A
            engine.generate(1)
            b = engine.snapshot()                      # B, queued behind A
            import time
            time.sleep(0.2)                            # the worker is done with A and waits for the lock
            engine.restore(b, verify=True)             # needs B's digest, with the lock held
        done.set()

    worker = threading.Thread(target=holder, daemon=True)
    worker.start()
    assert done.wait(20), "deadlock: the lock holder waited for a digest the worker could not reach"


@pytest.mark.parametrize("position", [0, 1, 37])
def test_copy_ranges_cover_the_live_state_with_touching_ranges_merged(position):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    layout = engine.capsules.layout
    ranges = layout.ranges(position)
    live = layout.fixed_bytes + sum(r.row_bytes * position for r in layout.regions if r.per_token)
    assert sum(e - s for s, e in ranges) == live
    assert all(s < e for s, e in ranges)
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:])), "touching ranges must be one copy"
    first_rows = min((r for r in layout.regions if r.per_token), key=lambda r: r.offset)
    if position and first_rows.offset == layout.fixed_bytes:
        assert ranges[0] == (0, layout.fixed_bytes + first_rows.row_bytes * position)
    # What a snapshot sizes its chunk with, from any row on (a snapshot that extends a base).
    for start in (0, 1, position, position + 3):
        assert layout.ranges_bytes(position, start) == sum(e - s for s, e in layout.ranges(position, start))


def _full_size(tokens: int) -> int:
    probe = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    probe.prefill(list(range(1, tokens + 1)))
    return probe.snapshot().nbytes


def test_a_snapshot_never_shares_rows_with_a_base_spilled_to_make_room_for_it():
    """B extends A, so it would share A's rows; making room for B spills A. B must not point
    at the pool bytes A just gave up: it copies everything instead."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, spill=True,
                                budgets={"device": _full_size(10) + 10_000, "host": 8 << 20})
    cold = Engine.from_config(ModelConfig.tiny(), max_seq_len=256)
    for e in (engine, cold):
        e.prefill(list(range(1, 11)))
    engine.snapshot("A")
    assert engine.generate(5) == cold.generate(5)
    live = engine.state_digest()
    engine.snapshot("B")
    assert {c.name: c.tier for c in engine.capsules.list()} == {"A": "host", "B": "device"}
    assert engine.capsules.get("B").digest == live
    engine.reset()
    engine.restore("B")
    assert engine.state_digest() == live
    assert engine.generate(5) == cold.generate(5)
    engine.capsules.drop("B")
    engine.capsules.drop("A")
    assert engine.capsules.used_bytes("device") == engine.capsules.used_bytes("host") == 0
    assert engine.capsules.pool.largest_free() == engine.capsules.budget_bytes("device")


def test_a_capsule_larger_than_the_pool_once_aligned_is_refused_without_spilling_anything():
    size = _full_size(10)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, spill=True,
                                budgets={"device": size + 8, "host": 8 << 20})   # the pool aligns to 256
    engine.prefill(list(range(1, 10)))
    engine.snapshot("small")
    engine.prefill([10])
    with pytest.raises(BudgetExceeded, match="exceeds the whole budget"):
        engine.snapshot("big")
    assert {c.name: c.tier for c in engine.capsules.list()} == {"small": "device"}


def test_a_snapshot_that_could_not_fit_after_spilling_moves_no_capsule_before_it_is_refused():
    """Pinned capsules fragment the pool so that even spilling every unpinned one leaves no
    run long enough: the refusal must come first, not after the spills (here, with a host
    tier that holds one capsule and no disk tier, they would have been evictions)."""
    from flashrt_ros.capsule.memory import DevicePool

    small, big = DevicePool.footprint(_full_size(8)), DevicePool.footprint(_full_size(40))
    assert small < big <= 4 * small   # fits the pool, but neither a freed slot nor the free tail
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, spill=True,
                                budgets={"device": 4 * small, "host": _full_size(8) + 1})
    for pin in (True, False, True):              # pinned, unpinned, pinned, back to back in the pool
        engine.reset()
        engine.prefill(list(range(1, 9)))
        engine.snapshot(pin=pin)
    engine.reset()
    engine.prefill(list(range(1, 9)))
    engine.snapshot(tier="host")                 # the host tier is full
    before = {c.id: c.tier for c in engine.capsules.list()}
    engine.reset()
    engine.prefill(list(range(1, 41)))
    engine.capsules.take_events()
    with pytest.raises(BudgetExceeded, match="would not fit even after spilling"):
        engine.snapshot()
    events = [kind for kind, _ in engine.capsules.take_events()]
    # Digests of the earlier snapshots may finish meanwhile; nothing else may happen.
    assert {c.id: c.tier for c in engine.capsules.list()} == before and set(events) <= {"digest"}


def test_a_shared_capsule_spilled_to_disk_counts_all_its_bytes_there_after_a_restart(tmp_path):
    size = _full_size(10)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path,
                                budgets={"device": 1 << 20, "host": size + 100, "disk": 8 << 20})
    engine.prefill(list(range(1, 11)))
    engine.snapshot("a", tier="host")
    assert engine.fork("a", name="f").nbytes == 0   # shares a's bytes
    engine.capsules.drop("a")
    engine.reset()
    engine.prefill(list(range(20, 30)))
    engine.snapshot("c", tier="host")                # no room: f goes down to disk, whole
    assert (engine.capsules.get("f").tier, engine.capsules.get("f").nbytes) == ("disk", size)
    engine.close()
    again = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    assert again.capsules.get("f").nbytes == size
    assert again.capsules.used_bytes("disk") == size
    again.close()


def test_a_spill_the_tier_below_cannot_take_evicts_instead_of_failing_half_way():
    """Making room on the device for C moves A and B down; the host (a pinned capsule in it)
    has room for A but never for B. B falls off the end, as from the last tier: the snapshot
    does not fail with A moved and B not."""
    from flashrt_ros.capsule.memory import DevicePool

    a_size, b_size = _full_size(4), _full_size(10)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, spill=True, budgets={
        "device": DevicePool.footprint(a_size) + DevicePool.footprint(b_size), "host": 2 * a_size + 1000})
    engine.prefill(list(range(1, 5)))
    engine.snapshot("A")
    engine.snapshot("P", tier="host", pin=True)
    engine.prefill(list(range(1, 7)))
    engine.snapshot("B")
    engine.prefill(list(range(1, 11)))                  # C needs the space of both
    engine.capsules.take_events()
    engine.snapshot("C")
    events = [(kind, info.name) for kind, info in engine.capsules.take_events()]
    assert {c.name: c.tier for c in engine.capsules.list()} == {"A": "host", "P": "host", "C": "device"}
    assert ("spill", "A") in events and ("evict", "B") in events


def test_a_fork_of_a_disk_capsule_never_spills_its_own_source_out_of_a_full_disk_tier(tmp_path):
    probe = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    probe.prefill(list(range(20)))
    size = probe.snapshot().nbytes
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64, capsule_dir=tmp_path, spill=True,
                                budgets={"device": 4 * (size + 256), "host": size, "disk": size})
    engine.prefill(list(range(20)))
    source = engine.snapshot("source", tier="disk")                  # the disk tier is full
    engine.reset()
    engine.prefill(list(range(1, 21)))
    engine.snapshot("on-host", tier="host")                          # and so is the host tier
    child = engine.fork("source", "child")   # host room: "on-host" cannot go down, so it goes
    events = [(kind, info.name, info.tier) for kind, info in engine.capsules.take_events()]
    assert [(i.name, i.tier) for i in engine.capsules.list()] == [("source", "disk"), ("child", "host")]
    assert [e for e in events if e[0] in ("evict", "spill", "fork")] == [("evict", "on-host", "host"),
                                                                          ("fork", "child", "host")]
    engine.restore(child.id, verify=True)
    assert engine.state_digest() == engine.capsules.get(source.id).digest


def test_a_failed_disk_write_costs_no_older_disk_capsule(tmp_path, monkeypatch):
    import errno

    from flashrt_ros.capsule import CapsuleError, diskformat

    size = _full_size(4)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path,
                                budgets={"disk": size + 100})
    engine.prefill([1, 2, 3, 4])
    old = engine.snapshot("old", tier="disk")

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diskformat, "_write_all", full_disk)
    with pytest.raises(CapsuleError, match="No space left"):
        engine.snapshot("new", tier="disk")               # would have evicted "old" to make room
    monkeypatch.undo()
    assert [c.id for c in engine.capsules.list()] == [old.id]
    assert engine.capsules.used_bytes("disk") == old.nbytes
    engine.restore(old.id, verify=True)


@pytest.mark.parametrize("lie", ["position past the arena", "unknown boundary kind", "id not an id",
                                 "history hash", "ranges"])
def test_a_resealed_file_that_describes_no_state_of_this_engine_is_skipped(tmp_path, lie, caplog):
    """Header and data digests can be recomputed by anyone: the loader also checks that the
    file describes a state this engine could have had."""
    from flashrt_ros.capsule import diskformat
    from flashrt_ros.capsule.disk_capsules import range_reader
    from flashrt_ros.digest import history_digest, state_digest

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    engine.prefill([1, 2, 3, 4])
    real = engine.snapshot("real", tier="disk")
    header, _ = diskformat.read(tmp_path / f"{real.id}{diskformat.SUFFIX}")
    for key in ("version", "header_digest"):
        header.pop(key)
    regions, fixed = engine.arena.regions, engine.arena.fixed_bytes
    position = 300 if lie == "position past the arena" else 4
    ranges = engine.capsules.layout.ranges(min(position, 4))
    total = sum(e - s for s, e in ranges)
    data = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    data[:fixed] = 0
    read = range_reader(ranges, data)
    if lie == "ranges":   # the same bytes, said to lie at other arena offsets
        ranges = [(0, total)]
    fake_id = "best" if lie == "id not an id" else "a" * 16
    forged = dict(header, id=fake_id, name="forged", position=position, nbytes=total,
                  ranges=[list(r) for r in ranges],
                  log=[["bogus" if lie == "unknown boundary kind" else "prefill", 0, position]],
                  digest=state_digest(engine.capsules.layout.ranges(min(position, 4)), read),
                  history_hash="0" * 64 if lie == "history hash" else history_digest(regions, min(position, 4), read))
    diskformat.write(tmp_path / f"{fake_id}{diskformat.SUFFIX}", forged, data)
    engine.close()
    reloaded = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    assert [c.name for c in reloaded.capsules.list()] == ["real"]
    assert "skipping capsule file" in caplog.text


def test_after_a_restart_the_oldest_disk_capsule_is_evicted_first(tmp_path):
    size = _full_size(4)
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path,
                                budgets={"disk": 3 * size + 100})
    engine.prefill([1, 2, 3, 4])
    made = [engine.snapshot(f"d{i}", tier="disk") for i in range(3)]
    engine.close()
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path,
                                budgets={"disk": 3 * size + 100})
    engine.prefill([1, 2, 3, 4])
    engine.snapshot("d3", tier="disk")
    assert sorted(c.name for c in engine.capsules.list()) == ["d1", "d2", "d3"], made


def test_a_chain_of_snapshots_holds_each_chunk_once_and_frees_them_all():
    """Each snapshot of a generation shares its base's rows, so the last one's pieces lie in
    every chunk of the chain: each is counted (and released) once, by identity."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(list(range(1, 9)))
    taken = []
    for _ in range(12):
        taken.append(engine.snapshot())
        engine.generate(1)
    record = engine.capsules.resolve(taken[-1])
    chunks = list(_chunks(record.pieces))
    assert len(chunks) == 12 and len({id(c) for c in chunks}) == 12
    for info in taken:
        engine.capsules.get(info)   # digests done: their jobs hold no chunk any more
    # The k-th chunk of the chain is held by the capsule that made it and by every later one.
    assert sorted(c.refs for c in chunks) == list(range(1, 13))
    for info in taken:
        engine.capsules.drop(info)
    assert engine.capsules.used_bytes("device") == 0


def test_a_pool_allocation_interrupted_as_its_chunk_is_made_loses_no_space(monkeypatch):
    """A snapshot allocates its chunk during its copy, where a Ctrl-C pressed meanwhile is raised:
    raised as the chunk is made, the free space must be as it was."""
    from flashrt_ros.capsule import memory

    pool = memory.DevicePool(1 << 16, torch.device("cpu"))
    before = list(pool._free)

    class Interrupted(memory.Chunk):
        def __init__(self, *args) -> None:
            raise KeyboardInterrupt

    monkeypatch.setattr(memory, "Chunk", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.allocate(1000)
    assert pool._free == before


def test_a_snapshot_interrupted_while_it_takes_its_holds_keeps_none_of_them(monkeypatch):
    """A Ctrl-C is raised between two bytecodes, here right after the new capsule took its hold
    on the base's shared chunk: the failed snapshot must leave that chunk held by the base
    alone, or dropping the base would never free its bytes."""
    from flashrt_ros.capsule import store as store_module

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    engine.prefill(list(range(1, 9)))
    base = engine.snapshot()
    engine.capsules.get(base)   # digest done: the base alone holds its chunk
    engine.generate(1)
    (base_chunk,) = _chunks(engine.capsules.resolve(base).pieces)
    assert base_chunk.refs == 1

    def interrupted_after_the_base(pieces):
        for chunk in _chunks(pieces):
            yield chunk
            if chunk is base_chunk:
                raise KeyboardInterrupt

    monkeypatch.setattr(store_module, "chunks_of", interrupted_after_the_base)
    with pytest.raises(KeyboardInterrupt):
        engine.snapshot()   # shares the base's 8 rows: its pieces start in the base's chunk
    monkeypatch.undo()
    assert base_chunk.refs == 1 and [c.id for c in engine.capsules.list()] == [base.id]
    engine.capsules.drop(base)
    assert engine.capsules.used_bytes("device") == 0


def test_a_fork_of_a_disk_capsule_interrupted_before_its_record_keeps_no_host_bytes(tmp_path, monkeypatch):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128, capsule_dir=tmp_path)
    engine.prefill(list(range(1, 9)))
    source = engine.snapshot(tier="disk")
    store = engine.capsules

    def interrupted(*args, **kwargs):   # the host chunk is filled; the Ctrl-C comes before the record
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "_register", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.fork(source)
    monkeypatch.undo()
    assert store.used_bytes("host") == 0 and [c.id for c in store.list()] == [source.id]

