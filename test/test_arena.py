"""The state arena: one allocation, named views, a region table, few live ranges, a digest of live bytes."""
from __future__ import annotations

import torch

from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.arena import GROUPS


def test_every_state_view_lives_in_the_one_allocation(tiny_engine):
    arena = tiny_engine.arena
    base = arena.buffer.data_ptr()
    for region in arena.regions:
        view = arena[region.name]
        assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
        assert view.data_ptr() == base + region.offset
        assert view.numel() * view.element_size() == region.nbytes
        assert region.offset % 256 == 0


def test_region_table_names_every_group_with_dtype_shape_and_bytes(tiny_engine):
    table = tiny_engine.region_table
    assert {r["group"] for r in table} == set(GROUPS)
    for row in table:
        assert set(row) == {"name", "group", "dtype", "shape", "offset", "nbytes", "per_token"}
    kv = next(r for r in table if r["name"] == "kv")
    assert kv["per_token"] and kv["shape"][0] == tiny_engine.max_seq_len


def test_live_state_is_one_range_per_per_token_region_plus_one(tiny_engine):
    tiny_engine.prefill(list(range(40)))
    arena, position = tiny_engine.arena, tiny_engine.position
    per_token = [r for r in arena.regions if r.per_token]
    ranges = arena.live_ranges(position)
    assert len(ranges) == 1 + len(per_token)
    live = sum(end - start for start, end in ranges)
    assert live == arena.fixed_bytes + sum(position * r.row_bytes for r in per_token)
    # KV alone (the ablation filter) is a single contiguous range.
    assert len(arena.live_ranges(position, groups=["kv"])) == 1


def test_layout_fingerprint_tracks_dtype_and_length_but_not_weights():
    cfg = ModelConfig.tiny()
    a = Engine.from_config(cfg, seed=0, max_seq_len=256)
    assert a.layout_fingerprint == Engine.from_config(cfg, seed=1, max_seq_len=256).layout_fingerprint
    assert a.layout_fingerprint != Engine.from_config(cfg, max_seq_len=512).layout_fingerprint
    assert a.layout_fingerprint != Engine.from_config(cfg, max_seq_len=256, dtype=torch.bfloat16).layout_fingerprint


def test_digest_covers_live_rows_only(tiny_engine):
    tiny_engine.prefill(list(range(10)))
    before = tiny_engine.state_digest()
    kv = tiny_engine.arena["kv"]
    kv[tiny_engine.position + 5].fill_(3.0)  # beyond the live prefix: not state
    assert tiny_engine.state_digest() == before
    kv[tiny_engine.position - 1].add_(1.0)   # inside it: state
    assert tiny_engine.state_digest() != before
