"""Faults of the fleet tier, each against a real valkey-server: the server down, killed
mid-publish, slow; chunks evicted or altered; manifests of another model or layout, unsigned
or signed with another key; two publishers at once. Every refusal has its code, leaves the
live state and the local tiers as they were, and restores nothing in part."""
from __future__ import annotations

import json
import threading
import time

import pytest

from fleet_harness import (OTHER_KEY, KeyValueServer, chunk_keys, engine, new_server,
                           snapshot, tier)
from flashrt_ros.capsule import CapsuleError
from flashrt_ros.capsule.fleet_chunks import digest
from flashrt_ros.errors import ErrorCode

PROMPT = list(range(3, 33))


def _refused(code: ErrorCode, call, *args, **kwargs) -> CapsuleError:
    with pytest.raises(CapsuleError) as refused:
        call(*args, **kwargs)
    assert refused.value.code == code, refused.value
    return refused.value


def _published(server: KeyValueServer, **options):
    """Engine a with a capsule "task" published, and engine b with a state of its own."""
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "task")
    tier(server, "a", **options).publish(a.capsules, taken.id)
    b.prefill([9, 9, 9, 9])
    return a, b, taken


def _untouched(e, before_digest: str, before_list: list) -> None:
    assert e.state_digest() == before_digest
    assert e.capsules.list() == before_list


def test_server_down_at_publish_and_at_pull_refuses_with_fleet_unavailable_and_works_once_it_is_back(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "task")
    b.prefill([9, 9])
    local_b = snapshot(b, "mine")
    fleet_a, fleet_b = tier(kv_server, "a"), tier(kv_server, "b")
    kv_server.stop()
    live_a, listed_a = a.state_digest(), a.capsules.list()
    error = _refused(ErrorCode.FLEET_UNAVAILABLE, fleet_a.publish, a.capsules, taken.id)
    assert "cannot reach the server" in str(error)
    _untouched(a, live_a, listed_a)
    live_b, listed_b = b.state_digest(), b.capsules.list()
    _refused(ErrorCode.FLEET_UNAVAILABLE, fleet_b.pull, b.capsules, taken.id)
    _refused(ErrorCode.FLEET_UNAVAILABLE, fleet_b.list)
    _untouched(b, live_b, listed_b)
    b.restore(local_b.id)   # the local tiers serve on
    assert fleet_b.stats().failures == 1

    kv_server.start()   # the same port, empty (no persistence): the same clients carry on
    fleet_a.publish(a.capsules, taken.id)
    b.restore(fleet_b.pull(b.capsules, "task").id)
    assert b.state_digest() == taken.digest


def test_a_publisher_that_dies_mid_publish_leaves_no_manifest_and_its_chunks_expire(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "task")

    def crash(sent: int, total: int) -> None:
        raise KeyboardInterrupt   # the process dies between two batches

    with pytest.raises(KeyboardInterrupt):
        tier(kv_server, "a", batch_bytes=16384, grace_s=5.0).publish(a.capsules, taken.id, progress=crash)
    client = kv_server.client()
    written = chunk_keys(kv_server)
    assert written and not client.exists(f"flashrt:manifest:{taken.id}", "flashrt:name:task")
    assert all(0 < client.pttl(key) <= 10_000 for key in written)   # 2 x grace: gone even without a collection
    _refused(ErrorCode.UNKNOWN_CAPSULE, tier(kv_server, "b").pull, b.capsules, "task")
    _refused(ErrorCode.UNKNOWN_CAPSULE, tier(kv_server, "b").pull, b.capsules, taken.id)
    assert tier(kv_server, "b").list() == [] and b.capsules.list() == []


def test_a_server_killed_mid_publish_comes_back_with_chunks_and_no_manifest_and_a_new_publish_completes(tmp_path):
    server = new_server(tmp_path, args=["--appendonly", "yes", "--appendfsync", "always"])
    server.start()
    try:
        a, b = engine(), engine()
        a.prefill(PROMPT)
        taken = snapshot(a, "task")
        fleet_a = tier(server, "a", batch_bytes=16384)

        def kill_after_the_first_batch(sent: int, total: int) -> None:
            if server.process.poll() is None:
                server.kill()

        _refused(ErrorCode.FLEET_UNAVAILABLE, fleet_a.publish, a.capsules, taken.id,
                 progress=kill_after_the_first_batch)
        server.start()   # replays its append-only file
        kept = chunk_keys(server)
        assert kept and not server.client().keys("flashrt:manifest:*") and not server.client().keys("flashrt:name:*")
        _refused(ErrorCode.UNKNOWN_CAPSULE, tier(server, "b").pull, b.capsules, "task")
        again = fleet_a.publish(a.capsules, taken.id)
        assert again.chunks_sent == again.chunks - len(kept)
        b.restore(tier(server, "b").pull(b.capsules, "task").id)
        assert b.state_digest() == taken.digest
    finally:
        server.stop()


def _chunk_of(server: KeyValueServer, capsule_id: str, index: int) -> bytes:
    manifest = json.loads(server.client().get(f"flashrt:manifest:{capsule_id}"))
    return f"flashrt:chunk:{manifest['chunks'][index][0]}".encode()


def test_a_missing_chunk_is_refused_with_incomplete_capsule_and_nothing_is_restored(kv_server):
    a, b, taken = _published(kv_server)
    kv_server.client().delete(_chunk_of(kv_server, taken.id, 5))
    live, listed = b.state_digest(), b.capsules.list()
    error = _refused(ErrorCode.INCOMPLETE_CAPSULE, tier(kv_server, "b").pull, b.capsules, "task")
    assert "chunk 5" in str(error) and "publish the capsule again" in str(error)
    _untouched(b, live, listed)
    _refused(ErrorCode.INCOMPLETE_CAPSULE, tier(kv_server, "b").hold, "task")
    # Published again, the chunk is back: only it is sent.
    assert tier(kv_server, "a").publish(a.capsules, taken.id).chunks_sent == 1


@pytest.mark.parametrize("change", ["same length", "shorter"])
def test_an_altered_chunk_is_refused_with_corrupt_capsule_and_removed_so_that_a_publish_repairs_it(kv_server, change):
    a, b, taken = _published(kv_server)
    key = _chunk_of(kv_server, taken.id, 2)
    client = kv_server.client()
    value = client.get(key)
    client.set(key, bytes([value[0] ^ 1]) + value[1:] if change == "same length" else value[:-4])
    live, listed = b.state_digest(), b.capsules.list()
    error = _refused(ErrorCode.CORRUPT_CAPSULE, tier(kv_server, "b").pull, b.capsules, "task")
    assert "chunk 2" in str(error) and "does not match its digest" in str(error)
    assert "removed from the server" in str(error) and client.exists(key) == 0
    _untouched(b, live, listed)
    # A publisher that holds the good bytes finds the chunk missing, and sends it alone.
    assert tier(kv_server, "a").publish(a.capsules, taken.id).chunks_sent == 1
    b.restore(tier(kv_server, "b").pull(b.capsules, "task").id)
    assert b.state_digest() == taken.digest


def test_chunks_evicted_under_maxmemory_are_refused_never_restored(kv_server):
    _, b, taken = _published(kv_server)
    client = kv_server.client()
    used = client.info("memory")["used_memory"]
    client.config_set("maxmemory-policy", "allkeys-lru")
    client.config_set("maxmemory", used + 256 * 1024)
    manifest = client.get(f"flashrt:manifest:{taken.id}")
    chunks = sorted({f"flashrt:chunk:{d}" for d, _ in json.loads(manifest)["chunks"]})
    for i in range(2000):   # until the server has evicted some of the capsule
        client.set(f"filler:{i}", b"x" * 4096)
        if i % 16 == 0 and client.exists(*chunks) < len(chunks):
            break
    assert client.exists(*chunks) < len(chunks)
    live, listed = b.state_digest(), b.capsules.list()
    with pytest.raises(CapsuleError) as refused:
        tier(kv_server, "b").pull(b.capsules, taken.id)
    # The manifest may have been evicted too: then there is no capsule at all.
    assert refused.value.code in (ErrorCode.INCOMPLETE_CAPSULE, ErrorCode.UNKNOWN_CAPSULE)
    _untouched(b, live, listed)


def test_a_full_server_without_eviction_refuses_a_publish_with_budget_exceeded(kv_server):
    a = engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "task")
    client = kv_server.client()
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 1024)
    error = _refused(ErrorCode.BUDGET_EXCEEDED, tier(kv_server, "a").publish, a.capsules, taken.id)
    assert "out of memory" in str(error)
    assert not client.keys("flashrt:manifest:*")


@pytest.mark.parametrize("prepared", [False, True], ids=["chunks named at the publish", "named with the digest"])
def test_a_capsule_damaged_in_the_publishers_memory_is_published_but_refused_by_every_reader(kv_server, prepared):
    a, b = engine(), engine()
    publisher = tier(kv_server, "a")
    if prepared:
        publisher.prepare(a.capsules)
    a.prefill(PROMPT)
    taken = snapshot(a, "damaged", tier="host")
    piece = a.capsules.resolve(taken.id).pieces[-1]
    piece.chunk.data[piece.offset] ^= 0xFF   # a bit flip in host memory, after the digest was taken
    publisher.publish(a.capsules, taken.id)
    live, listed = b.state_digest(), b.capsules.list()
    error = _refused(ErrorCode.CORRUPT_CAPSULE, tier(kv_server, "b").pull, b.capsules, "damaged")
    # Named with the digest, the damaged chunk is found by its name; named at the publish, the
    # chunks match their names and only the whole fails.
    assert ("its chunks verify" not in str(error)) == prepared and "does not match its digest" in str(error)
    _untouched(b, live, listed)


def test_a_damaged_publisher_does_not_keep_a_good_capsule_that_shares_its_chunk_from_restoring(kv_server):
    """Named with the digest, damaged bytes go out under a good name; a good capsule sharing
    the block finds it there and does not send it. Its first reader removes it; the next
    publish repairs it."""
    a, c, b = engine(), engine(), engine()
    damaged, good = tier(kv_server, "a"), tier(kv_server, "c")
    damaged.prepare(a.capsules)
    good.prepare(c.capsules)
    a.prefill(PROMPT)
    c.prefill(PROMPT)
    broken, kept = snapshot(a, "damaged", tier="host"), snapshot(c, "good", tier="host")
    piece = a.capsules.resolve(broken.id).pieces[-1]
    piece.chunk.data[piece.offset] ^= 0xFF   # the first row of the last region: a full block both share
    damaged.publish(a.capsules, broken.id)
    assert good.publish(c.capsules, kept.id).chunks_sent == 0
    live, listed = b.state_digest(), b.capsules.list()
    error = _refused(ErrorCode.CORRUPT_CAPSULE, tier(kv_server, "b").pull, b.capsules, "good")
    assert "removed from the server" in str(error)
    _untouched(b, live, listed)
    assert good.publish(c.capsules, kept.id).chunks_sent == 1
    b.restore(tier(kv_server, "b").pull(b.capsules, "good").id)
    assert b.state_digest() == kept.digest


def test_a_capsule_of_another_model_or_layout_is_refused_with_fingerprint_mismatch(kv_server):
    _, _, taken = _published(kv_server)
    for other in (engine(seed=1), engine(max_seq_len=32)):
        live, listed = other.state_digest(), other.capsules.list()
        _refused(ErrorCode.FINGERPRINT_MISMATCH, tier(kv_server, "b").pull, other.capsules, "task")
        _untouched(other, live, listed)
    # list() shows it, with the fingerprints to compare.
    (listed,) = tier(kv_server, "b").list()
    assert listed.info.model_fingerprint == taken.model_fingerprint


def test_an_unsigned_manifest_or_one_signed_with_another_key_is_refused_with_untrusted_capsule(kv_server):
    a, b, taken = _published(kv_server)
    client = kv_server.client()
    key = f"flashrt:manifest:{taken.id}"
    unsigned = json.loads(client.get(key))
    del unsigned["signature"]
    client.set(key, json.dumps(unsigned))
    live, listed = b.state_digest(), b.capsules.list()
    error = _refused(ErrorCode.UNTRUSTED_CAPSULE, tier(kv_server, "b").pull, b.capsules, taken.id)
    assert "not signed" in str(error)
    assert tier(kv_server, "b").list() == []   # skipped, not shown

    a.prefill([4, 4])
    other = snapshot(a, "other-key")
    tier(kv_server, "a", key=OTHER_KEY).publish(a.capsules, other.id)
    _refused(ErrorCode.UNTRUSTED_CAPSULE, tier(kv_server, "b").pull, b.capsules, other.id)
    # Its name entry is signed with the other key too.
    _refused(ErrorCode.UNTRUSTED_CAPSULE, tier(kv_server, "b").pull, b.capsules, "other-key")
    _untouched(b, live, listed)


def test_a_name_pointed_at_another_capsule_without_the_key_is_refused(kv_server):
    a, b, taken = _published(kv_server)
    a.prefill([1, 2])
    other = snapshot(a)
    tier(kv_server, "a").publish(a.capsules, other.id)
    client = kv_server.client()
    signature = client.get("flashrt:name:task").split(b" ")[1]
    client.set("flashrt:name:task", other.id.encode() + b" " + signature)
    _refused(ErrorCode.UNTRUSTED_CAPSULE, tier(kv_server, "b").pull, b.capsules, "task")


def test_a_forged_chunk_with_a_valid_name_but_other_bytes_of_the_manifest_is_refused(kv_server):
    """Chunks are named by their bytes: a chunk set under another chunk's name is caught."""
    _, b, taken = _published(kv_server)
    client = kv_server.client()
    first, second = _chunk_of(kv_server, taken.id, 0), _chunk_of(kv_server, taken.id, 1)
    assert digest(client.get(first)) == first.decode().rpartition(":")[2]
    client.set(second, client.get(first))   # same length (both full fixed-block pieces), other bytes
    _refused(ErrorCode.CORRUPT_CAPSULE, tier(kv_server, "b").pull, b.capsules, "task")


def test_two_publishers_of_the_same_content_at_once_leave_one_copy_of_each_chunk(kv_server):
    a1, a2 = engine(), engine()
    a1.prefill(PROMPT)
    a2.prefill(PROMPT)
    c1, c2 = snapshot(a1), snapshot(a2)
    assert c1.digest == c2.digest and c1.id != c2.id
    tiers = [tier(kv_server, "a1"), tier(kv_server, "a2")]
    start = threading.Barrier(4)
    results, errors = [], []

    def publish(fleet, e, capsule_id):
        start.wait()
        try:
            for _ in range(3):
                results.append(fleet.publish(e.capsules, capsule_id))
        except Exception as exc:   # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=args) for args in
               [(tiers[0], a1, c1.id), (tiers[1], a2, c2.id), (tiers[1], a2, c2.id)]]
    for t in threads:
        t.start()
    start.wait()
    for t in threads:
        t.join(60)
    assert not errors
    chunks = results[0].chunks
    assert len(chunk_keys(kv_server)) == chunks   # one capsule's worth: every chunk written once
    assert sum(r.chunks_sent for r in results) == chunks
    assert sorted(c.info.id for c in tiers[0].list()) == sorted([c1.id, c2.id])


def test_a_slow_server_is_bounded_by_the_timeout_with_fleet_unavailable(kv_server):
    a, b, taken = _published(kv_server)
    fleet_b = tier(kv_server, "b", timeout_s=0.5, connect_timeout_s=0.5)
    fleet_a = tier(kv_server, "a", timeout_s=0.5, connect_timeout_s=0.5)
    a.prefill([1])
    newer = snapshot(a)
    kv_server.pause()   # it accepts connections and answers nothing
    try:
        live, listed = b.state_digest(), b.capsules.list()
        began = time.monotonic()
        error = _refused(ErrorCode.FLEET_UNAVAILABLE, fleet_b.pull, b.capsules, "task")
        assert "did not answer within 0.5 s" in str(error)
        _refused(ErrorCode.FLEET_UNAVAILABLE, fleet_a.publish, a.capsules, newer.id)
        # A bound, not a speed: two calls of one timeout each, far from a hang.
        assert time.monotonic() - began < 30
        _untouched(b, live, listed)
    finally:
        kv_server.resume()
    b.restore(fleet_b.pull(b.capsules, "task").id)
    assert b.state_digest() == taken.digest


def test_a_deadline_bounds_a_whole_pull(kv_server):
    _, b, _ = _published(kv_server)
    error = _refused(ErrorCode.FLEET_UNAVAILABLE, tier(kv_server, "b", batch_bytes=16384).pull, b.capsules, "task",
                     deadline_s=1e-9)
    assert "deadline" in str(error) and b.capsules.list() == []
