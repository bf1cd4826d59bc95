"""The released models' shapes (runtime.released) and the state sizes computed from them: what
docs/thor.md's table rests on."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.bench.sizes import rows
from flashrt_ros.runtime.arena import StateArena
from flashrt_ros.runtime.models.qwen35 import state_specs
from flashrt_ros.runtime.released import RELEASED, SOURCES, parameters, state_bytes, state_config

NOMINAL = {"Qwen3.5-0.8B": 0.8, "Qwen3.5-2B": 2, "Qwen3.5-4B": 4, "Qwen3.5-9B": 9, "Qwen3.5-27B": 27,
           "Qwen3.5-35B-A3B": 35}


@pytest.mark.parametrize("name", list(RELEASED))
def test_each_released_config_parses_with_its_source_and_its_shapes_make_its_size(name):
    cfg = state_config(RELEASED[name])
    assert SOURCES[name]
    assert len(cfg.full_layers) * 3 == len(cfg.linear_layers) == 3 * len(cfg.layer_types) // 4
    # The shapes together come to the size the model is named for: a wrong width or count would not.
    assert abs(parameters(RELEASED[name]) / 1e9 - NOMINAL[name]) < 0.1 * NOMINAL[name]


def test_the_computed_state_is_the_arena_s_own_and_the_measured_capsule_of_the_0_8b_shape():
    cfg = state_config(RELEASED["Qwen3.5-0.8B"])
    for dtype in (torch.bfloat16, torch.float32):
        fixed, per_token = state_bytes(cfg, dtype)
        arena = StateArena(state_specs(cfg, 32, dtype), torch.device("cpu"))
        assert 0 <= arena.fixed_bytes - fixed < 4096                              # alignment only
        assert 0 <= (arena.nbytes - arena.fixed_bytes) - 32 * per_token < 4096
    fixed, per_token = state_bytes(cfg, torch.float32)
    # A transformers-saved checkpoint of this shape, loaded in fp32, gave a 21.6 MB capsule at 48 tokens.
    assert round((fixed + 48 * per_token) / 1e6, 1) == 21.6


def test_the_thor_table_leaves_room_for_capsules_beside_every_model():
    table = rows(max_seq_len=32768, rollback_depth=16, max_draft=4)
    assert [r["model"] for r in table] == list(RELEASED)
    assert all(r["left"] > 8 << 30 and r["capsule_4k"] < r["capsule_16k"] for r in table)
