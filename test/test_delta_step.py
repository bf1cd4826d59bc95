"""Decode's linear-attention mixer on the package's C library (src/delta_step.c): where it runs,
that it follows the torch mixer it replaces, refusals, and journals that record it."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.session import engine_for, session_of
from flashrt_ros.runtime import Engine, ModelConfig, delta_step

GROUPED_CONV3 = ModelConfig.tiny(
    vocab_size=317, hidden_size=72, intermediate_size=100,
    layer_types=("full_attention", "linear_attention", "linear_attention"),
    num_attention_heads=3, num_key_value_heads=1, head_dim=24, linear_num_key_heads=1, linear_num_value_heads=3,
    linear_key_head_dim=20, linear_value_head_dim=12, linear_conv_kernel_dim=3)
NO_CONV_STATE = ModelConfig.tiny(vocab_size=280, hidden_size=64, layer_types=("linear_attention", "full_attention"),
                                 linear_conv_kernel_dim=1)


def test_the_build_installs_the_kernel():
    """colcon builds it (CMakeLists.txt); without it decode would silently run the torch mixer."""
    assert delta_step.available()


def test_it_runs_with_native_decode_only():
    cfg = ModelConfig.tiny()
    assert Engine.from_config(cfg, max_seq_len=64).model.has_native_delta()
    assert not Engine.from_config(cfg, max_seq_len=64, decode_native=False).model.has_native_delta()
    assert not Engine.from_config(cfg, max_seq_len=64, dtype=torch.bfloat16).model.has_native_delta()


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), GROUPED_CONV3, NO_CONV_STATE], ids=["tiny", "grouped", "k1"])
def test_it_follows_the_torch_mixer(cfg):
    """Same products on both sides (the C row kernel); only the mixers differ: same greedy
    tokens, logits and state within float32 rounding."""
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    native, torch_mixer = Engine.from_config(cfg, max_seq_len=128), Engine.from_config(cfg, max_seq_len=128)
    for block in torch_mixer.model.blocks:
        block.delta = None
    assert not torch_mixer.model.has_native_delta()
    for engine in (native, torch_mixer):
        engine.prefill(ids)
    assert native.generate(40) == torch_mixer.generate(40)
    assert (native.logits() - torch_mixer.logits()).abs().max() < 1e-5
    for region in ("recurrent", "conv"):
        assert torch.allclose(native.arena.views[region], torch_mixer.arena.views[region], atol=1e-5)


def test_wrong_tensors_are_refused_before_the_kernel_touches_them():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    block = next(b for b in engine.model.blocks if b.delta is not None)
    state = engine.model.recurrent[block.slot]
    before = state.clone()
    with pytest.raises(ValueError, match="one float32 CPU row"):
        block.delta(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="one float32 CPU row"):
        block.delta(torch.zeros(2, block.in_proj.w.shape[1]))
    assert torch.equal(state, before)
    conv = engine.model.conv[block.slot]
    with pytest.raises(ValueError, match="norm_weight must be a contiguous float32"):
        delta_step.DeltaStep(conv, block.conv, block.neg_a, block.dt_bias, state, block.norm_a.double(),
                             key_heads=engine.config.linear_num_key_heads, q_scale=1.0, k_scale=1.0,
                             qk_eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match="do not make a conv"):
        delta_step.DeltaStep(conv, block.conv, block.neg_a, block.dt_bias, state, block.norm_a,
                             key_heads=engine.config.linear_num_key_heads + 1, q_scale=1.0, k_scale=1.0,
                             qk_eps=1e-6, norm_eps=1e-6)


def test_journals_record_it_and_refuse_another_version():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    recorded = session_of(engine, "", 0)
    assert recorded["delta_step"] == delta_step.version() != ""
    assert engine_for(recorded).model.has_native_delta()
    with pytest.raises(InvalidArgument, match="delta_step kernel '0'.*may round differently"):
        engine_for(recorded | {"delta_step": "0"})
    # Recorded by a build whose native decode had no mixer kernel: its steps would not replay.
    with pytest.raises(InvalidArgument, match="delta_step kernel ''"):
        engine_for({k: v for k, v in recorded.items() if k != "delta_step"})
