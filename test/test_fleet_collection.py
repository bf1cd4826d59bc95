"""Collection of the chunks no manifest names, against a real valkey-server: only chunks older
than the grace go, never one a manifest names, and never one a publisher in progress is about
to name (its commit finds the chunk gone or its touch stale, and sends it again)."""
from __future__ import annotations

import json
import random
import threading
import time

import pytest

from fleet_harness import chunk_keys, engine, snapshot, tier
from flashrt_ros.capsule import CapsuleError
from flashrt_ros.errors import ErrorCode

PROMPT = list(range(3, 33))
GRACE = 0.3


def _orphans(server, e, **options) -> set[bytes]:
    """Chunks of a capsule whose publisher died before its manifest: the keys it left."""
    before = chunk_keys(server)
    e.prefill([11, 12, 13])
    taken = snapshot(e)

    def die(sent: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tier(server, "dead", **options).publish(e.capsules, taken.id, progress=die)
    return chunk_keys(server) - before


def test_collection_removes_only_unnamed_chunks_older_than_the_grace(kv_server):
    a = engine()
    a.prefill(PROMPT)
    named = tier(kv_server, "a", grace_s=GRACE).publish(a.capsules, snapshot(a, "kept").id)
    kept = chunk_keys(kv_server)
    orphans = _orphans(kv_server, a, grace_s=GRACE, batch_bytes=40000)
    assert orphans and len(kept) == named.chunks
    # A collector whose grace the orphans are younger than keeps them (a grace far longer than
    # this test: the other way round it would assume how fast the machine runs).
    fresh = tier(kv_server, "patient", grace_s=60.0).collect()
    assert fresh.chunks_deleted == 0 and chunk_keys(kv_server) == kept | orphans
    time.sleep(GRACE + 0.2)
    done = tier(kv_server, "collector", grace_s=GRACE).collect()
    assert done.chunks_deleted == len(orphans) and done.bytes_freed > 0 and done.manifests == 1
    assert chunk_keys(kv_server) == kept
    b = engine()
    b.restore(tier(kv_server, "b").pull(b.capsules, "kept").id)
    assert b.state_digest() == named.info.digest


def test_chunks_of_a_dropped_capsule_go_at_the_next_collection_but_shared_ones_stay(kv_server):
    a = engine()
    fleet = tier(kv_server, "a", grace_s=GRACE)
    a.prefill(PROMPT)
    first = fleet.publish(a.capsules, snapshot(a, "first").id)
    a.prefill(list(range(40, 52)))
    second = fleet.publish(a.capsules, snapshot(a, "second").id)
    time.sleep(GRACE + 0.2)
    assert fleet.drop("first") is True
    done = fleet.collect()
    shared = 3 * len(a.capsules.layout.rows)   # the full 8-row blocks of the first 30 rows, in each region
    assert done.chunks_deleted == first.chunks - shared and len(chunk_keys(kv_server)) == second.chunks
    b = engine()
    b.restore(tier(kv_server, "b").pull(b.capsules, "second").id)
    assert b.state_digest() == second.info.digest


def test_a_collection_during_a_publish_keeps_the_chunks_it_just_touched(kv_server):
    a = engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "racing")
    collector = tier(kv_server, "collector", grace_s=60.0)
    collected = []
    # Between two batches of the publish: its chunks are touched and some sent, none named yet.
    tier(kv_server, "a", grace_s=60.0, batch_bytes=16384).publish(
        a.capsules, taken.id, progress=lambda sent, total: collected.append(collector.collect()))
    assert collected and all(c.chunks_deleted == 0 for c in collected)
    b = engine()
    b.restore(tier(kv_server, "b").pull(b.capsules, "racing").id)
    assert b.state_digest() == taken.digest


def test_a_publish_slower_than_the_grace_loses_its_chunks_to_a_collection_and_sends_them_again(kv_server, caplog):
    a = engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "slow")
    grace = 1.0   # the publish again, after the stall, must finish within it
    collector = tier(kv_server, "collector", grace_s=grace)
    deleted = []

    def stall_once(sent: int, total: int) -> None:
        if not deleted:
            time.sleep(grace + 0.2)   # the chunks touched so far are older than the grace now
            deleted.append(collector.collect().chunks_deleted)

    published = tier(kv_server, "a", grace_s=grace, batch_bytes=16384).publish(a.capsules, taken.id,
                                                                              progress=stall_once)
    assert deleted[0] > 0 and "sending again" in caplog.text
    assert published.chunks_sent == published.chunks + deleted[0]
    b = engine()
    b.restore(tier(kv_server, "b").pull(b.capsules, "slow").id)
    assert b.state_digest() == taken.digest


def test_publishers_and_collectors_at_once_never_leave_a_manifest_without_its_chunks(kv_server):
    engines = [engine(), engine()]
    for i, e in enumerate(engines):
        e.prefill([i + 1] * 4)
    stop = threading.Event()
    failures: list[Exception] = []
    published: list[str] = []
    dropped: list[str] = []

    def publish(i: int, e) -> None:
        fleet = tier(kv_server, f"p{i}", grace_s=GRACE, batch_bytes=16384)
        draw = random.Random(i)

        def now_and_then_slower_than_the_grace(sent: int, total: int) -> None:
            if draw.random() < 0.1:
                time.sleep(GRACE + 0.05)

        for step in range(8):
            e.prefill([step + 2])
            taken = snapshot(e)
            try:
                published.append(fleet.publish(e.capsules, taken.id, ttl_s=60,
                                               progress=now_and_then_slower_than_the_grace).info.id)
                if step % 3 == 0:
                    fleet.drop(taken.id)
                    dropped.append(taken.id)
            except CapsuleError as exc:   # a publish that gave up: refused, never half-done
                failures.append(exc)

    def collect() -> None:
        fleet = tier(kv_server, "collector", grace_s=GRACE)
        while not stop.is_set():
            fleet.collect()

    collector = threading.Thread(target=collect)
    collector.start()
    publishers = [threading.Thread(target=publish, args=(i, e)) for i, e in enumerate(engines)]
    for t in publishers:
        t.start()
    for t in publishers:
        t.join(120)
    stop.set()
    collector.join(60)
    # A publish stalled past its grace three times gives up, refused whole; nothing else fails.
    assert published and all(f.code == ErrorCode.IO_ERROR for f in failures), failures
    client = kv_server.client()
    listed = tier(kv_server, "reader").list()
    assert {c.info.id for c in listed} == set(published) - set(dropped)
    for capsule in listed:
        manifest = json.loads(client.get(f"flashrt:manifest:{capsule.info.id}"))
        assert all(client.exists(f"flashrt:chunk:{d}") for d, _ in manifest["chunks"]), capsule.info.id


def test_an_unreadable_manifest_stops_a_collection_from_deleting_anything(kv_server):
    a = engine()
    orphans = _orphans(kv_server, a, grace_s=GRACE)
    kv_server.client().set("flashrt:manifest:0123456789abcdef", b"{not json")
    time.sleep(GRACE + 0.2)
    done = tier(kv_server, "collector", grace_s=GRACE).collect()
    assert done.chunks_deleted == 0 and done.unreadable == ("flashrt:manifest:0123456789abcdef",)
    assert orphans <= chunk_keys(kv_server)
