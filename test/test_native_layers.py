"""Decode's attention layers on the package's C library (src/delta_step.c for linear attention,
src/attention_step.c for full attention): where they run, that they follow the torch layers
they replace, refusals, and journals that record them."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.session import engine_for, session_of
from flashrt_ros.runtime import Engine, ModelConfig, attention_step, delta_step

GROUPED_CONV3 = ModelConfig.tiny(
    vocab_size=317, hidden_size=72, intermediate_size=100,
    layer_types=("full_attention", "linear_attention", "linear_attention"),
    num_attention_heads=3, num_key_value_heads=1, head_dim=24, linear_num_key_heads=1, linear_num_value_heads=3,
    linear_key_head_dim=20, linear_value_head_dim=12, linear_conv_kernel_dim=3)
NO_CONV_STATE_HALF_ROTARY = ModelConfig.tiny(
    vocab_size=280, hidden_size=64, layer_types=("linear_attention", "full_attention"), linear_conv_kernel_dim=1,
    num_attention_heads=2, num_key_value_heads=2, head_dim=20, partial_rotary_factor=0.5)
KERNELS = {"delta": "has_native_delta", "attend": "has_native_attention"}


def test_the_build_installs_the_kernels():
    """colcon builds them (CMakeLists.txt); without them decode would silently run the torch layers."""
    assert delta_step.available() and attention_step.available()


def test_they_run_with_native_decode_only():
    cfg = ModelConfig.tiny()
    native = Engine.from_config(cfg, max_seq_len=64).model
    assert native.has_native_delta() and native.has_native_attention()
    for other in (Engine.from_config(cfg, max_seq_len=64, decode_native=False),
                  Engine.from_config(cfg, max_seq_len=64, dtype=torch.bfloat16)):
        assert not other.model.has_native_delta() and not other.model.has_native_attention()


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), GROUPED_CONV3, NO_CONV_STATE_HALF_ROTARY],
                         ids=["tiny", "grouped", "k1_half_rotary"])
def test_each_follows_the_torch_layer(cfg, kernel):
    """The same products on both sides (the C row kernel) and one kernel switched off on one
    side: the same greedy tokens, logits and state within float32 rounding."""
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    native, torch_layer = Engine.from_config(cfg, max_seq_len=128), Engine.from_config(cfg, max_seq_len=128)
    for block in torch_layer.model.blocks:
        setattr(block, kernel, None)
    assert not getattr(torch_layer.model, KERNELS[kernel])() and getattr(native.model, KERNELS[kernel])()
    for engine in (native, torch_layer):
        engine.prefill(ids)
    assert native.generate(40) == torch_layer.generate(40)
    assert (native.logits() - torch_layer.logits()).abs().max() < 1e-5
    for region in ("recurrent", "conv", "kv"):
        assert torch.allclose(native.arena.views[region], torch_layer.arena.views[region], atol=1e-5)


def test_wrong_rows_are_refused_before_a_kernel_touches_the_state():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    before = engine.arena.buffer.clone()
    for block in engine.model.blocks:
        layer = block.delta or block.attend
        width = block.in_proj.w.shape[1]
        for row in (torch.zeros(1, 5), torch.zeros(2, width), torch.zeros(1, width, dtype=torch.float64)):
            with pytest.raises(ValueError, match="one float32 CPU row"):
                layer(row)
    assert torch.equal(engine.arena.buffer, before)


def test_wrong_tensors_are_refused_when_a_layer_is_bound():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    model, cfg = engine.model, engine.config
    lin = next(b for b in model.blocks if b.delta is not None)
    conv, state = model.conv[lin.slot], model.recurrent[lin.slot]
    with pytest.raises(ValueError, match="norm_weight must be a contiguous float32"):
        delta_step.DeltaStep(conv, lin.conv, lin.neg_a, lin.dt_bias, state, lin.norm_a.double(),
                             key_heads=cfg.linear_num_key_heads, q_scale=1.0, k_scale=1.0, qk_eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match="do not make a conv"):
        delta_step.DeltaStep(conv, lin.conv, lin.neg_a, lin.dt_bias, state, lin.norm_a,
                             key_heads=cfg.linear_num_key_heads + 1, q_scale=1.0, k_scale=1.0, qk_eps=1e-6,
                             norm_eps=1e-6)
    full = next(b for b in model.blocks if b.attend is not None)
    keys, values = model.kv[:, full.slot, 0], model.kv[:, full.slot, 1]
    with pytest.raises(ValueError, match="values must be float32 CPU cache rows"):
        attention_step.AttentionStep(keys, values[:32], model.position, full.norm_a, model.cos, model.sin,
                                     heads=cfg.num_attention_heads, eps=1e-6)
    with pytest.raises(ValueError, match="cos must be a contiguous float32"):
        attention_step.AttentionStep(keys, values, model.position, full.norm_a, model.cos[:10], model.sin,
                                     heads=cfg.num_attention_heads, eps=1e-6)
    with pytest.raises(ValueError, match="position must be the arena's int64"):
        attention_step.AttentionStep(keys, values, model.position.float(), full.norm_a, model.cos, model.sin,
                                     heads=cfg.num_attention_heads, eps=1e-6)


@pytest.mark.parametrize("kernel", ["delta_step", "attention_step"])
def test_journals_record_them_and_refuse_another_version(kernel):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    recorded = session_of(engine, "", 0)
    here = {"delta_step": delta_step.version(), "attention_step": attention_step.version()}
    assert recorded[kernel] == here[kernel] != ""
    replayed = engine_for(recorded).model
    assert replayed.has_native_delta() and replayed.has_native_attention()
    with pytest.raises(InvalidArgument, match=f"{kernel} kernel '0'.*may round differently"):
        engine_for(recorded | {kernel: "0"})
    # Recorded by a build whose native decode lacked this kernel: its steps would not replay.
    with pytest.raises(InvalidArgument, match=f"{kernel} kernel ''"):
        engine_for({k: v for k, v in recorded.items() if k != kernel})
