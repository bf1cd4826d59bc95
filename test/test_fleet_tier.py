"""The fleet tier against a real valkey-server: a capsule published by one engine is pulled by
another with the same fingerprints, restores byte-exact and generates the same tokens; a
capsule pulled once is served locally; lineages share chunks; names, leases and drops."""
from __future__ import annotations

import json
import time

import pytest

from fleet_harness import KEY, OTHER_KEY, CHUNKS, TlsFront, chunk_keys, engine, snapshot, tier
from flashrt_ros.capsule import CapsuleError, diskformat
from flashrt_ros.capsule import fleet as fleet_module
from flashrt_ros.capsule.fleet import FleetTier
from flashrt_ros.capsule.fleet_chunks import chunk_bytes, chunking_for, digest, wire_chunks
from flashrt_ros.errors import ErrorCode

PROMPT = list(range(3, 33))


def test_a_published_capsule_pulled_by_another_engine_restores_byte_exact_and_generates_the_same_tokens(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "task")
    published = tier(kv_server, "a").publish(a.capsules, taken.id)
    assert (published.info.id, published.info.tier, published.chunks_sent) == (taken.id, "fleet", published.chunks)
    expected = a.generate(6)

    b.prefill([7, 7, 7])
    pulled = tier(kv_server, "b").pull(b.capsules, "task")
    assert (pulled.id, pulled.name, pulled.tier, pulled.digest) == (taken.id, "task", "host", taken.digest)
    assert b.capsules.take_events()[-1] == ("pull", pulled)
    b.restore(pulled.id, verify=True)
    assert b.state_digest() == taken.digest and b.position == len(PROMPT)
    assert b.generate(6) == expected
    # The pulled capsule is an ordinary local one: forks and rollbacks to positions it logged work.
    b.fork(pulled.id, name="branch")
    assert b.rollback(to_position=len(PROMPT) - 4) == len(PROMPT) - 4


def test_a_capsule_published_and_pulled_over_tls_restores_byte_exact(kv_server, tmp_path):
    front = TlsFront(kv_server, tmp_path)
    try:
        a, b = engine(), engine()
        a.prefill(PROMPT)
        taken = snapshot(a, "task")
        over_tls = {"node": "a", **CHUNKS}
        published = FleetTier(front.url, KEY, **over_tls).publish(a.capsules, taken.id)
        assert published.chunks > 4   # several batches' worth of replies read off the TLS socket
        fleet_b = FleetTier(front.url, KEY, **{**over_tls, "node": "b", "batch_bytes": 16384})
        b.restore(fleet_b.pull(b.capsules, "task").id, verify=True)
        assert b.state_digest() == taken.digest
        assert fleet_b.stats().pulled == 1
    finally:
        front.close()


def test_a_capsule_pulled_once_is_served_locally_without_the_server(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a)
    fleet_b = tier(kv_server, "b")
    tier(kv_server, "a").publish(a.capsules, taken.id)
    fleet_b.pull(b.capsules, taken.id)
    kv_server.stop()
    assert fleet_b.pull(b.capsules, taken.id).id == taken.id
    assert fleet_b.stats().served_locally == 1 and fleet_b.stats().pulled == 1
    b.restore(taken.id)
    assert b.state_digest() == taken.digest


def test_a_disk_capsule_published_and_pulled_into_a_disk_tier_loads_there_at_the_next_start(kv_server, tmp_path):
    a = engine(capsule_dir=tmp_path / "a")
    a.prefill(PROMPT)
    taken = snapshot(a, "task", tier="disk")
    tier(kv_server, "a").publish(a.capsules, taken.id)
    b = engine(capsule_dir=tmp_path / "b", capsule_key=KEY)
    pulled = tier(kv_server, "b").pull(b.capsules, "task", tier="disk")
    assert pulled.tier == "disk" and diskformat.path_for(tmp_path / "b", taken.id).exists()
    b.close()
    again = engine(capsule_dir=tmp_path / "b", capsule_key=KEY)
    assert [(c.id, c.name, c.digest) for c in again.capsules.list()] == [(taken.id, "task", taken.digest)]
    again.restore("task")
    assert again.state_digest() == taken.digest


def test_capsules_of_one_lineage_share_their_full_row_blocks_on_the_server(kv_server):
    a = engine()
    fleet = tier(kv_server, "a")
    a.prefill(PROMPT)
    first = fleet.publish(a.capsules, snapshot(a).id)
    a.prefill(list(range(40, 52)))
    second = fleet.publish(a.capsules, snapshot(a).id)
    rows = chunking_for(a.capsules.layout, 8, 16384).rows
    shared_blocks = len(PROMPT) // rows * len(a.capsules.layout.rows)   # full blocks of each per-token region
    assert rows == 8 and len(PROMPT) // rows == 3
    assert second.chunks_sent == second.chunks - shared_blocks
    assert len(chunk_keys(kv_server)) == first.chunks + second.chunks - shared_blocks
    # Publishing a capsule again sends nothing.
    assert fleet.publish(a.capsules, first.info.id).chunks_sent == 0


def test_a_fork_made_on_one_engine_restores_on_the_other(kv_server):
    a, b = engine(), engine()
    fleet_a, fleet_b = tier(kv_server, "a"), tier(kv_server, "b")
    a.prefill(PROMPT)
    fleet_a.publish(a.capsules, snapshot(a, "root").id)
    b.restore(fleet_b.pull(b.capsules, "root").id)
    b.prefill([9, 8, 7, 6, 5])
    fork = b.capsules.get(b.fork(name="b-branch").id)
    fleet_b.publish(b.capsules, fork.id)
    a.reset()
    a.restore(fleet_a.pull(a.capsules, "b-branch").id)
    assert a.state_digest() == fork.digest and a.position == len(PROMPT) + 5


def test_a_name_is_a_tag_that_moves_to_the_latest_capsule_published_under_it(kv_server):
    a, b = engine(), engine()
    fleet_a, fleet_b = tier(kv_server, "a"), tier(kv_server, "b")
    a.prefill(PROMPT)
    old = fleet_a.publish(a.capsules, snapshot(a).id, name="robot7-last").info
    a.prefill([5, 6, 7])
    new = fleet_a.publish(a.capsules, snapshot(a).id, name="robot7-last").info
    assert fleet_b.resolve("robot7-last") == new.id
    listed = {c.info.id: c for c in fleet_b.list()}
    assert listed[new.id].names == ("robot7-last",) and listed[old.id].names == ()
    assert fleet_b.pull(b.capsules, old.id).name == ""   # pulled by id: no name to give it


def test_a_lease_bounds_the_capsule_and_its_chunks_outlive_it_by_the_grace(kv_server):
    a = engine()
    fleet = tier(kv_server, "a", grace_s=30.0)
    a.prefill(PROMPT)
    taken = snapshot(a, "leased")
    fleet.publish(a.capsules, taken.id, ttl_s=100.0)   # longer than a new chunk's own 2 x grace
    client = kv_server.client()

    def expires_at(key) -> int:   # server ms
        return client.execute_command("PEXPIRETIME", key)

    assert 0 < client.pttl(f"flashrt:manifest:{taken.id}") <= 100_000
    end = expires_at(f"flashrt:manifest:{taken.id}")
    assert expires_at("flashrt:name:leased") == expires_at(f"flashrt:holders:{taken.id}") == end
    assert all(expires_at(key) == end + 30_000 for key in chunk_keys(kv_server))
    (listed,) = fleet.list()
    assert listed.holders == ("a",) and 0 < listed.expires_in_s <= 100.0
    # A hold until dropped makes the capsule and its chunks persist.
    tier(kv_server, "b").hold("leased")
    assert client.pttl(f"flashrt:manifest:{taken.id}") == -1
    assert all(client.pttl(key) == -1 for key in chunk_keys(kv_server))


def test_a_short_lease_ends_and_takes_the_manifest_and_its_name_with_it(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    fleet = tier(kv_server, "a")
    fleet.publish(a.capsules, snapshot(a, "brief").id, ttl_s=0.3)
    time.sleep(0.5)
    with pytest.raises(CapsuleError) as refused:
        tier(kv_server, "b").pull(b.capsules, "brief")
    assert refused.value.code == ErrorCode.UNKNOWN_CAPSULE
    assert fleet.list() == []


def test_drop_removes_this_nodes_reference_and_the_last_one_removes_the_capsule(kv_server):
    a = engine()
    fleet_a, fleet_b = tier(kv_server, "a"), tier(kv_server, "b")
    a.prefill(PROMPT)
    taken = snapshot(a, "shared")
    fleet_a.publish(a.capsules, taken.id)
    fleet_b.hold("shared", ttl_s=60.0)
    assert fleet_a.drop("shared") is False       # b still holds it
    assert [c.holders for c in fleet_b.list()] == [("b",)]
    with pytest.raises(CapsuleError) as refused:
        fleet_a.drop(taken.id)
    assert refused.value.code == ErrorCode.UNKNOWN_CAPSULE and "holds no reference" in str(refused.value)
    assert fleet_b.drop("shared") is True
    client = kv_server.client()
    assert not client.exists(f"flashrt:manifest:{taken.id}", f"flashrt:holders:{taken.id}", "flashrt:name:shared",
                             f"flashrt:names:{taken.id}")
    assert fleet_a.list() == []
    # The chunks stay until a collection (or their own expiry); the local capsule is untouched.
    assert chunk_keys(kv_server) and a.capsules.get(taken.id).digest == taken.digest


def test_two_prefixes_on_one_server_are_two_fleets(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "task")
    tier(kv_server, "a", prefix="fleet-one").publish(a.capsules, taken.id)
    other = tier(kv_server, "b", prefix="fleet-two")
    assert other.list() == []
    with pytest.raises(CapsuleError) as refused:
        other.pull(b.capsules, "task")
    assert refused.value.code == ErrorCode.UNKNOWN_CAPSULE
    assert chunk_keys(kv_server, "fleet-one") and not chunk_keys(kv_server, "fleet-two")


def test_the_manifest_names_every_chunk_of_the_cut_in_order(kv_server):
    a = engine()
    a.prefill(PROMPT)
    taken = snapshot(a)
    published = tier(kv_server, "a").publish(a.capsules, taken.id)
    spans = wire_chunks(a.capsules.layout, taken.position, chunking_for(a.capsules.layout, 8, 16384))
    assert published.chunks == len(spans) and published.nbytes == sum(e - s for s, e in spans)


def _names(e, capsule_id, chunking):
    info, _, data = e.capsules.export(capsule_id)
    return tuple(digest(chunk_bytes(data.numpy(), span)) for span in wire_chunks(e.capsules.layout, info.position,
                                                                                 chunking))


def test_a_prepared_store_names_each_capsules_chunks_with_its_digest_and_a_publish_hashes_nothing(
        kv_server, tmp_path, monkeypatch):
    a, b = engine(capsule_dir=tmp_path), engine()
    fleet = tier(kv_server, "a")
    chunking = fleet.chunking(a.capsules.layout)
    a.prefill(PROMPT)
    before = snapshot(a)                                    # made before: hashed whole, its chunks not named
    fleet.prepare(a.capsules)
    taken, on_disk = snapshot(a, "named"), snapshot(a, tier="disk")
    forked = a.capsules.get(a.fork("named", "forked").id)
    for unnamed in (before, on_disk):   # a disk capsule's file is read and verified at its publish anyway
        assert a.capsules.chunk_names(unnamed.id, chunking) is None
    for info in (taken, forked):
        assert a.capsules.chunk_names(info.id, chunking) == _names(a, info.id, chunking)
    assert a.capsules.chunk_names(taken.id, chunking._replace(rows=4)) is None   # another cut: not these names
    assert a.capsules.chunk_names("0123456789abcdef", chunking) is None

    def no_hashing(value):
        raise AssertionError("a publish of a prepared store's capsule hashed a chunk")

    monkeypatch.setattr(fleet_module, "digest", no_hashing)
    fleet.publish(a.capsules, taken.id)
    b.restore(tier(kv_server, "b").pull(b.capsules, "named").id)
    assert b.state_digest() == taken.digest
    a.capsules.name_chunks(None)
    assert a.capsules.chunk_names(snapshot(a).id, chunking) is None


def test_a_capsule_whose_last_chunks_repeat_earlier_ones_is_pulled_whole(kv_server):
    """Chunks are fetched once each: the rows of a region that are all alike are one chunk,
    placed at every use, the last one included, and hashed in order all the same."""
    a, b = engine(), engine()
    a.prefill([5, 6, 7])
    region = next(r for r in a.arena.regions if r.name == "mtp.kv")
    a.arena.buffer[region.offset:region.offset + region.nbytes] = 0
    taken = snapshot(a, "alike")
    options = {"chunk_rows": 1, "chunk_bytes": 4096}
    published = tier(kv_server, "a", **options).publish(a.capsules, taken.id)
    manifest = kv_server.client().get(f"flashrt:manifest:{taken.id}")
    names = [d for d, _ in json.loads(manifest)["chunks"]]
    assert names[-1] in names[:-1] and published.chunks_sent < published.chunks
    b.restore(tier(kv_server, "b", **options).pull(b.capsules, "alike").id)
    assert b.state_digest() == taken.digest


def test_the_default_chunking_serves_an_engine_shorter_than_a_row_block(kv_server):
    a, b = engine(), engine()
    a.prefill(PROMPT)
    taken = snapshot(a, "default")
    fleet = FleetTier(kv_server.url, KEY, node="a")   # 256-row blocks, 4 MiB chunks; the engine has 64 rows
    # The fixed block, and one partial row block of each per-token region.
    assert fleet.publish(a.capsules, taken.id).chunks == 1 + len(a.capsules.layout.rows)
    b.restore(FleetTier(kv_server.url, KEY, node="b").pull(b.capsules, "default").id)
    assert b.state_digest() == taken.digest


def test_the_same_capsule_id_under_another_key_is_a_conflict_not_an_overwrite(kv_server):
    a = engine()
    a.prefill(PROMPT)
    taken = snapshot(a)
    tier(kv_server, "a").publish(a.capsules, taken.id)
    with pytest.raises(CapsuleError) as refused:
        tier(kv_server, "a", key=OTHER_KEY).publish(a.capsules, taken.id)
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT and "another manifest" in str(refused.value)
