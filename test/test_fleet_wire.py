"""The fleet tier's wire format, without a server: the cut into chunks covers every byte of a
capsule once, on row-block boundaries that capsules of one lineage share; the manifest is the
same bytes whoever publishes the capsule, and is refused on any change without the key."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fleet_harness import KEY, OTHER_KEY, engine, snapshot
from flashrt_ros.capsule import CapsuleError, Layout, signing
from flashrt_ros.capsule.fleet_chunks import (Chunking, arena_chunks, chunk_bytes, chunk_digests, chunking_for, digest,
                                              wire_chunks)
from flashrt_ros.capsule.fleet_manifest import decode, encode
from flashrt_ros.errors import ErrorCode
from flashrt_ros.runtime.arena import Region


def _covered_once(layout: Layout, position: int, chunking: Chunking) -> None:
    chunks = wire_chunks(layout, position, chunking)
    assert all(0 < e - s <= chunking.most_bytes for s, e in chunks)
    # In order, end to end, they are the capsule's data: each chunk starts where the last ended.
    assert [s for s, _ in chunks] == [0] + [e for _, e in chunks[:-1]]
    assert chunks[-1][1] == layout.ranges_bytes(position)


@pytest.mark.parametrize("rows, most", [(8, 16384), (1, 4096), (256, 1 << 22), (3, 4096)])
def test_the_cut_tiles_a_capsules_data_in_order_within_the_chunk_size(rows, most):
    layout = engine().capsules.layout
    for position in (0, 1, 7, 8, 9, 30, 64):
        _covered_once(layout, position, chunking_for(layout, rows, most))


def test_each_chunk_is_one_regions_rows_and_lies_in_the_arena_where_its_bytes_come_from():
    e = engine()
    e.prefill(list(range(1, 30)))
    info, _, data = e.capsules.export(snapshot(e).id)
    layout, chunking = e.capsules.layout, Chunking(8, 4096)
    arena = e.arena.buffer.numpy()
    wire, spans = wire_chunks(layout, 29, chunking), arena_chunks(layout, 29, chunking)
    assert len(wire) == len(spans)
    for (s, e_), (a, b) in zip(wire, spans):
        assert (data.numpy()[s:e_] == arena[a:b]).all()
    # Past the fixed block, every region is cut into blocks of 8 rows: 29 rows are 4 blocks each.
    fixed = len(wire_chunks(layout, 0, chunking))
    assert len(wire) == fixed + 4 * len(layout.rows)


def test_one_pass_names_every_chunk_and_gives_the_capsule_digest():
    e = engine()
    e.prefill(list(range(1, 30)))
    taken = snapshot(e)
    info, _, data = e.capsules.export(taken.id)
    layout, chunking = e.capsules.layout, Chunking(8, 4096)
    whole, names = chunk_digests(layout, 29, chunking, lambda s, e_: e.arena.buffer.numpy()[s:e_])
    assert whole == taken.digest
    assert list(names) == [digest(chunk_bytes(data.numpy(), span)) for span in wire_chunks(layout, 29, chunking)]


def test_a_row_larger_than_a_chunk_is_cut_within_the_row():
    big = Region("kv", "kv", torch.float32, (16, 2000), 4096, 16 * 8000, True)
    fixed = Region("meta.position", "meta", torch.int64, (1,), 0, 8, False)
    layout = Layout((fixed, big), 4096, "fp", ())
    chunking = chunking_for(layout, 256, 4096)
    assert chunking.rows == 1
    _covered_once(layout, 5, chunking)
    assert len(wire_chunks(layout, 5, chunking)) == 1 + 5 * 2


def test_capsules_of_one_lineage_cut_their_common_full_blocks_into_the_same_chunks():
    e = engine()
    e.prefill(list(range(1, 21)))
    first = e.capsules.export(snapshot(e).id)
    e.prefill([5, 6, 7, 8, 9, 10, 11])
    second = e.capsules.export(snapshot(e).id)
    layout, chunking = e.capsules.layout, Chunking(8, 16384)

    def digests(exported):
        info, _, data = exported
        return [digest(chunk_bytes(data.numpy(), span)) for span in wire_chunks(layout, info.position, chunking)]

    one, two = digests(first), digests(second)
    fixed = len(wire_chunks(layout, 0, chunking))
    assert not set(one[:fixed]) & set(two[:fixed])                 # the recurrent state moved on
    for region in range(len(layout.rows)):                          # 20 rows: 3 blocks; 27 rows: 4
        a, b = one[fixed + 3 * region:][:3], two[fixed + 4 * region:][:4]
        assert a[:2] == b[:2]                                       # rows [0, 16): both hold them whole
        assert a[2] != b[2]                                         # rows [16, 20) against [16, 24)


def test_chunks_placed_back_make_the_capsules_data_again():
    e = engine()
    e.prefill(list(range(1, 30)))
    info, _, data = e.capsules.export(snapshot(e).id)
    array = data.numpy()
    out = np.zeros_like(array)
    for span in wire_chunks(e.capsules.layout, info.position, Chunking(8, 4096)):
        out[span[0]:span[1]] = np.frombuffer(bytes(chunk_bytes(array, span)), dtype=np.uint8)
    assert (out == array).all()


def _manifest(tmp_path):
    # Room on the host for one capsule: a second one spills the first to disk.
    e = engine(capsule_dir=tmp_path, budgets={"host": 100_000})
    e.prefill(list(range(1, 30)))
    taken = snapshot(e, "named", tier="host")
    layout, chunking = e.capsules.layout, Chunking(8, 16384)
    info, log_runs, data = e.capsules.export(taken.id)
    digests = [digest(chunk_bytes(data.numpy(), s)) for s in wire_chunks(layout, info.position, chunking)]
    return e, taken, encode(info, log_runs, layout, chunking, digests, KEY)


def test_a_manifest_is_the_same_bytes_from_any_tier_and_carries_no_local_name(tmp_path):
    e, taken, manifest = _manifest(tmp_path)
    e.reset()
    e.prefill([9, 8, 7])
    snapshot(e, tier="host")
    assert e.capsules.get(taken.id).tier == "disk"
    info, log_runs, data = e.capsules.export(taken.id)
    layout, chunking = e.capsules.layout, Chunking(8, 16384)
    digests = [digest(chunk_bytes(data.numpy(), s)) for s in wire_chunks(layout, info.position, chunking)]
    assert encode(info, log_runs, layout, chunking, digests, KEY) == manifest
    body = json.loads(manifest)
    assert body["capsule"]["name"] == "" and body["capsule"]["tier"] == "fleet"
    assert manifest == signing.canonical(body, ())
    decoded = decode(manifest, KEY, layout, e.capsules.log_kinds, e.capsules.model_fingerprint, taken.id)
    assert decoded.info._replace(tier="host", name="named", nbytes=taken.nbytes) == taken
    assert decoded.log == log_runs


def _refused(code, manifest, e, capsule_id, key=KEY):
    with pytest.raises(CapsuleError) as refused:
        decode(manifest, key, e.capsules.layout, e.capsules.log_kinds, e.capsules.model_fingerprint, capsule_id)
    assert refused.value.code == code, refused.value
    return str(refused.value)


def _resigned(manifest: bytes, change) -> bytes:
    body = json.loads(manifest)
    change(body)
    body["signature"] = signing.sign(KEY, body)
    return json.dumps(body).encode()


def test_a_manifest_changed_without_the_key_is_untrusted(tmp_path):
    e, taken, manifest = _manifest(tmp_path)
    _refused(ErrorCode.UNTRUSTED_CAPSULE, manifest, e, taken.id, key=OTHER_KEY)
    changed = manifest.replace(b'"position":29', b'"position":28')
    assert "signature does not match" in _refused(ErrorCode.UNTRUSTED_CAPSULE, changed, e, taken.id)


@pytest.mark.parametrize("change, message", [
    (lambda b: b["chunks"].pop(), "cut into"),
    (lambda b: b["chunks"][0].__setitem__(1, 5), "is not [digest"),
    (lambda b: b["chunks"][0].__setitem__(0, "XYZ"), "is not [digest"),
    (lambda b: b.__setitem__("chunking", {"rows": 0, "bytes": 16384}), "out of range"),
    (lambda b: b.__setitem__("chunking", {"rows": 8, "bytes": 1 << 40}), "out of range"),
    (lambda b: b["capsule"].__setitem__("ranges", [[0, 1]]), "other arena ranges"),
    (lambda b: b["capsule"].__setitem__("log", [["prefill", 0, 3]]), "log covers"),
    (lambda b: b["capsule"].__setitem__("nbytes", 12), "bytes, a capsule at position"),
    (lambda b: b["capsule"].__setitem__("id", "0123456789abcdef"), "describes capsule"),
    (lambda b: b.__setitem__("version", 99), "version"),
])
def test_a_signed_manifest_that_does_not_hold_together_is_corrupt(tmp_path, change, message):
    e, taken, manifest = _manifest(tmp_path)
    assert message in _refused(ErrorCode.CORRUPT_CAPSULE, _resigned(manifest, change), e, taken.id)


def test_a_manifest_larger_than_any_capsule_of_the_layout_takes_is_refused_before_it_is_parsed(tmp_path):
    e, taken, manifest = _manifest(tmp_path)
    assert "more than one of this engine's" in _refused(ErrorCode.CORRUPT_CAPSULE, manifest + b" " * (64 << 20),
                                                        e, taken.id)
