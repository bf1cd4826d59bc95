"""What a CUDA graph captures, checked on any machine. Every step the decoder would capture
(decode greedy, sampled and within a top-k/top-p cut, the policy step, each verify pass), for
a dense, an MoE (with a shared expert) and a policy model in fp32 and bf16, is built and run on
the meta device. Its tensors hold no values, so a read back to the host (item, tolist, bool, a
shape that depends on values) cannot run there, as it cannot run inside a capture; and a tensor
made on the host meets the device's in an op and fails, as it would on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from flashrt_ros.runtime import ModelConfig
from flashrt_ros.runtime.arena import StateArena
from flashrt_ros.runtime.decoding import Decoder
from flashrt_ros.runtime.models.qwen35 import Qwen35, state_specs
from flashrt_ros.runtime.weights import seeded_weights

META = torch.device("meta")
MAX_DRAFT = 4
MOE = dict(intermediate_size=0, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
CONFIGS = {"dense": ModelConfig.tiny(), "moe": ModelConfig.tiny(**MOE),
           "policy": ModelConfig.tiny(obs_dim=6, action_dim=3)}
# Ops whose result is read on the host, or whose shape depends on values: each syncs on CUDA.
HOST_READS = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "bincount", "unique",
              "_unique2", "unique_consecutive"}


class _NoHostReads(TorchDispatchMode):
    """Fails any op in ``HOST_READS``; counts the ops it saw."""

    ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func._schema.name.split("::")[-1]
        if name in HOST_READS:
            raise AssertionError(f"{name} reads values back to the host: a CUDA graph cannot capture it")
        return func(*args, **(kwargs or {}))


def _decoder(cfg: ModelConfig, dtype: torch.dtype, fixed: bool = True) -> Decoder:
    """An engine's model, arena and decoder (as ``Engine._build`` makes them) on the meta device."""
    max_draft = MAX_DRAFT if cfg.mtp_num_hidden_layers else 0
    model = Qwen35(cfg, seeded_weights(cfg, seed=0), META, dtype, 64, fixed_shapes=fixed)
    arena = StateArena(state_specs(cfg, 64, dtype), META)
    model.bind(arena, verify_rows=max_draft + 1 if max_draft else 0)
    return Decoder(model, arena, max_seq_len=64, prefill_chunk=8, fixed_shapes=fixed, cuda_graphs=False,
                   max_draft=max_draft)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_every_step_a_graph_captures_reads_nothing_back_and_stays_on_the_device(kind, dtype):
    decoder = _decoder(CONFIGS[kind], dtype)
    steps = decoder.steps
    assert set(steps) == {"greedy", "sampled", "cut"} | ({"policy"} if kind == "policy" else set()) | {
        f"verify {n}" for n in range(2, MAX_DRAFT + 2)}
    for name, step in steps.items():
        with _NoHostReads() as probe:
            step()
        assert probe.ops > 100, name   # the step ran its model through the probe


def test_the_check_catches_what_a_capture_cannot_take():
    """Not vacuous: the MoE model's grouped decode (what runs eagerly at live shapes, never
    captured) counts each expert's rows on the host, and fails the check; a value read from a
    meta tensor and a host tensor in a device op fail as well."""
    grouped = _decoder(CONFIGS["moe"], torch.float32, fixed=False)
    with pytest.raises(AssertionError, match="bincount reads values back"), _NoHostReads():
        grouped.steps["greedy"]()
    with pytest.raises((RuntimeError, NotImplementedError)):
        grouped.model.position.item()
    with pytest.raises(RuntimeError):
        torch.ones(3, device=META) + torch.ones(3)
