"""Decode's layers on the package's C library (src/delta_step.c for linear attention, prefill's too,
src/attention_step.c for full attention, src/row_ops.c for the norms, residuals and activations
between products): where they run, that they follow the torch code they replace, refusals,
and journals that record them."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.session import engine_for, session_of
from flashrt_ros.runtime import Engine, ModelConfig, attention_step, delta_step, row_ops
from flashrt_ros.runtime.layers import rms_norm
from thread_counts import at_thread_counts

GROUPED_CONV3 = ModelConfig.tiny(
    vocab_size=317, hidden_size=72, intermediate_size=100,
    layer_types=("full_attention", "linear_attention", "linear_attention"),
    num_attention_heads=3, num_key_value_heads=1, head_dim=24, linear_num_key_heads=1, linear_num_value_heads=3,
    linear_key_head_dim=20, linear_value_head_dim=12, linear_conv_kernel_dim=3)
NO_CONV_STATE_HALF_ROTARY = ModelConfig.tiny(
    vocab_size=280, hidden_size=64, layer_types=("linear_attention", "full_attention"), linear_conv_kernel_dim=1,
    num_attention_heads=2, num_key_value_heads=2, head_dim=20, partial_rotary_factor=0.5)
# Value heads of 20 (a vector block of 16 and a tail) over a conv of 176 channels (two of the
# kernel's units of work and part of a third).
WIDE_HEADS = ModelConfig.tiny(
    vocab_size=300, hidden_size=64, layer_types=("linear_attention", "full_attention"), linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=24, linear_value_head_dim=20)
KERNELS = {"delta": "has_native_delta", "attend": "has_native_attention"}


def test_the_build_installs_the_kernels():
    """colcon builds them (CMakeLists.txt); without them decode would silently run the torch code."""
    assert delta_step.available() and attention_step.available() and row_ops.available()


def test_they_run_with_native_decode_only():
    cfg = ModelConfig.tiny()
    native = Engine.from_config(cfg, max_seq_len=64).model
    assert native.has_native_delta() and native.has_native_attention() and native.native_glue
    for other in (Engine.from_config(cfg, max_seq_len=64, decode_native=False),
                  Engine.from_config(cfg, max_seq_len=64, dtype=torch.bfloat16)):
        assert not (other.model.has_native_delta() or other.model.has_native_attention() or other.model.native_glue)


def test_the_row_ops_follow_torch():
    g = torch.Generator().manual_seed(5)
    x, h, scale = (torch.randn(1, 77, generator=g) for _ in range(3))
    scale = scale[0].contiguous()
    assert torch.allclose(row_ops.rms_norm(x, scale, 1e-6), rms_norm(x, scale, 1e-6), atol=1e-6)
    total, normed = row_ops.add_rms_norm(x, h, scale, 1e-6)
    assert torch.equal(total, x + h) and torch.allclose(normed, rms_norm(x + h, scale, 1e-6), atol=1e-6)
    gate_up = torch.randn(1, 2 * 77, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(row_ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-6)
    with pytest.raises(ValueError, match="one float32 CPU row of 77"):
        row_ops.rms_norm(torch.randn(2, 77), scale, 1e-6)
    with pytest.raises(ValueError, match="scale must be a contiguous float32"):
        row_ops.check_scale(scale.double(), 77)


def test_the_glue_follows_torch_in_a_model():
    cfg = GROUPED_CONV3
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=torch.Generator().manual_seed(6))
    native, torch_glue = Engine.from_config(cfg, max_seq_len=96), Engine.from_config(cfg, max_seq_len=96)
    torch_glue.model.native_glue = False
    for engine in (native, torch_glue):
        engine.prefill(ids)
    assert native.generate(30) == torch_glue.generate(30)
    assert (native.logits() - torch_glue.logits()).abs().max() < 1e-5


@pytest.mark.parametrize("kernel", sorted(KERNELS))
@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), GROUPED_CONV3, NO_CONV_STATE_HALF_ROTARY, WIDE_HEADS],
                         ids=["tiny", "grouped", "k1_half_rotary", "wide_heads"])
def test_each_follows_the_torch_layer(cfg, kernel):
    """The same products on both sides (the C row kernel) and one kernel switched off on one
    side: the same greedy tokens, logits and state within float32 rounding."""
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    native, torch_layer = Engine.from_config(cfg, max_seq_len=128), Engine.from_config(cfg, max_seq_len=128)
    for block in torch_layer.model.blocks:
        setattr(block, kernel, None)
    if kernel == "attend":   # the MTP layer's K and V rows go through the attention kernel too
        torch_layer.model.mtp_kv_rows = None
    assert not getattr(torch_layer.model, KERNELS[kernel])() and getattr(native.model, KERNELS[kernel])()
    for engine in (native, torch_layer):
        engine.prefill(ids)
    assert native.generate(40) == torch_layer.generate(40)
    assert (native.logits() - torch_layer.logits()).abs().max() < 1e-5
    assert cfg.mtp_num_hidden_layers and "mtp.kv" in native.arena.views
    for region in ("recurrent", "conv", "kv", "mtp.kv"):
        assert torch.allclose(native.arena.views[region], torch_layer.arena.views[region], atol=1e-5)


def _delta_layer(cfg: ModelConfig, n: int) -> tuple[Engine, Any, torch.Tensor]:
    """An engine's first linear layer with its kernel, and ``n`` input rows for it (gates and
    conv inputs of ordinary sizes)."""
    engine = Engine.from_config(cfg, max_seq_len=16)
    block = next(b for b in engine.model.blocks if b.delta is not None)
    rows = torch.randn(n, block.in_proj.w.shape[1], generator=torch.Generator().manual_seed(7))
    return engine, block, rows


def _delta_state(engine: Engine) -> torch.Tensor:
    return torch.cat([engine.arena.views[r].flatten() for r in ("conv", "recurrent")])


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), GROUPED_CONV3, NO_CONV_STATE_HALF_ROTARY, WIDE_HEADS],
                         ids=["tiny", "grouped", "k1_half_rotary", "wide_heads"])
def test_a_prompt_through_the_delta_kernel_is_its_tokens_one_by_one(cfg):
    """Prefill runs the rule token after token, as decode does: a prompt in one call, in pieces
    (shorter than the conv's window, too) and token by token give the same bytes."""
    outs, states = [], []
    for pieces in ((9,), (2, 1, 6), (1,) * 9):
        engine, block, rows = _delta_layer(cfg, 9)
        starts = [sum(pieces[:i]) for i in range(len(pieces))]
        outs.append(torch.cat([block.delta(rows[s:s + p]).clone() for s, p in zip(starts, pieces)]))
        states.append(_delta_state(engine))
    assert all(torch.equal(outs[0], out) for out in outs) and all(torch.equal(states[0], s) for s in states)
    assert outs[0].abs().sum() > 0 and states[0].abs().sum() > 0


@pytest.mark.parametrize("cfg", [GROUPED_CONV3, WIDE_HEADS], ids=["grouped", "wide_heads"])
def test_the_delta_kernel_is_the_same_bytes_at_any_thread_count_and_in_its_portable_loops(cfg):
    engine, block, rows = _delta_layer(cfg, 40)
    views = [engine.arena.views[region] for region in ("conv", "recurrent")]
    saved = [view.clone() for view in views]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        for view, before in zip(views, saved):
            view.copy_(before)
        return block.delta(rows).clone(), _delta_state(engine)

    outs = at_thread_counts(run, (1, 2, 3))
    delta_step.use_portable_loops(True)
    try:
        outs.append(run())
    finally:
        delta_step.use_portable_loops(False)
    assert all(torch.equal(outs[0][0], o) and torch.equal(outs[0][1], s) for o, s in outs)


def test_the_delta_kernels_silu_is_zero_far_below_zero():
    """SiLU(z) = z / (1 + e^-z) is -0 in floats from about -89 down, as torch has it: a gate
    there closes its head's output exactly (the kernel's own exp stops at e^88)."""
    engine, block, rows = _delta_layer(WIDE_HEADS, 4)
    cfg = engine.config
    gates = cfg.conv_dim   # where a row's gates (z) start; value head 0's come first
    for i, gate in enumerate((-100.0, -1e30, -torch.finfo(torch.float32).max)):
        rows[i, gates:gates + cfg.linear_value_head_dim] = gate
    out = block.delta(rows)
    head0 = out[:3, :cfg.linear_value_head_dim]
    assert torch.equal(head0, torch.zeros_like(head0)) and out.isfinite().all() and out[3].abs().sum() > 0


def test_attention_is_the_same_bytes_at_any_thread_count_under_flush_to_zero():
    """Threads take whole KV heads and the caller's flush-to-zero: a gate of -88 makes a
    denormal sigmoid (about 6e-39), which the calling thread flushes to 0 and a worker thread
    in its own mode would not."""
    engine = Engine.from_config(NO_CONV_STATE_HALF_ROTARY, max_seq_len=16)   # two KV heads
    block = next(b for b in engine.model.blocks if b.attend is not None)
    cfg = engine.config
    q_k, heads = (cfg.num_attention_heads + cfg.num_key_value_heads) * cfg.head_dim, cfg.num_attention_heads
    row = torch.zeros(1, block.in_proj.w.shape[1])
    row[0, q_k:q_k + heads * cfg.head_dim] = -88.0          # the gate
    row[0, q_k + heads * cfg.head_dim:] = 1.0                 # the value row
    engine.model.position.fill_(5)
    at_thread_counts(lambda: torch.ones(1 << 22).add_(1), (3,))   # OpenMP's threads made before the mode is set
    torch.set_flush_denormal(True)
    try:
        outs = at_thread_counts(lambda: block.attend(row).clone(), (1, 2, 3))
    finally:
        torch.set_flush_denormal(False)
    assert all(torch.equal(outs[0], out) for out in outs) and not outs[0].any()


def test_a_position_outside_the_caches_is_refused():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=16)
    block = next(b for b in engine.model.blocks if b.attend is not None)
    engine.model.position.fill_(16)
    before = engine.arena.buffer.clone()
    with pytest.raises(ValueError, match="position 16 is outside the caches' 16 rows"):
        block.attend(torch.zeros(1, block.in_proj.w.shape[1]))
    assert torch.equal(engine.arena.buffer, before)


def test_wrong_rows_are_refused_before_a_kernel_touches_the_state():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    before = engine.arena.buffer.clone()
    for block in engine.model.blocks:
        layer, width = block.delta or block.attend, block.in_proj.w.shape[1]
        wrong = [torch.zeros(1, 5), torch.zeros(1, width, dtype=torch.float64), torch.zeros(0, width)]
        if block.attend is not None:   # one token at a time; the delta kernel takes a prompt's rows too
            wrong.append(torch.zeros(2, width))
        for row in wrong:
            with pytest.raises(ValueError, match="float32 CPU rows? of"):
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
    # A layer with value heads of width 0: the kernel would size its scratch by it.
    heads, key_dim = state.shape[0], state.shape[1]
    with pytest.raises(ValueError, match="value heads of 0 with"):
        delta_step.DeltaStep(torch.zeros(conv.shape[0], 2 * cfg.linear_key_dim), torch.zeros(conv.shape[0] + 1,
                             2 * cfg.linear_key_dim), lin.neg_a, lin.dt_bias, torch.zeros(heads, key_dim, 0),
                             torch.zeros(0), key_heads=cfg.linear_num_key_heads, q_scale=1.0, k_scale=1.0,
                             qk_eps=1e-6, norm_eps=1e-6)
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


@pytest.mark.parametrize("kernel", ["delta_step", "attention_step", "row_ops"])
def test_journals_record_them_and_refuse_another_version(kernel):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    recorded = session_of(engine, "", 0)
    here = {"delta_step": delta_step.version(), "attention_step": attention_step.version(),
            "row_ops": row_ops.version()}
    assert recorded[kernel] == here[kernel] != ""
    replayed = engine_for(recorded).model
    assert replayed.has_native_delta() and replayed.has_native_attention()
    with pytest.raises(InvalidArgument, match=f"{kernel} kernel '0'.*may round differently"):
        engine_for(recorded | {kernel: "0"})
    # Recorded by a build whose native decode lacked this kernel: its steps would not replay.
    with pytest.raises(InvalidArgument, match=f"{kernel} kernel ''"):
        engine_for({k: v for k, v in recorded.items() if k != kernel})
