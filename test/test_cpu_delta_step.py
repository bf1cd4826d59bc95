"""Linear attention on the CPU backend's delta kernel (src/delta_step.c), decode's and prefill's:
where it runs, that it follows the torch layer it replaces, refusals, and journals that record it."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.session import engine_for, session_of
from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.backends.cpu import delta_step
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


def test_the_build_installs_the_kernel():
    """colcon builds it (CMakeLists.txt); without it linear attention would silently run on torch."""
    assert delta_step.available()


def test_it_runs_with_the_cpu_backend_only():
    cfg = ModelConfig.tiny()
    assert all(b.delta is not None for b in Engine.from_config(cfg, max_seq_len=64).model.blocks
               if b.kind == "linear_attention")
    for other in (Engine.from_config(cfg, max_seq_len=64, cpu_kernels=False),
                  Engine.from_config(cfg, max_seq_len=64, dtype=torch.bfloat16)):
        assert all(b.delta is None for b in other.model.blocks)


@pytest.mark.parametrize("cfg", [ModelConfig.tiny(), GROUPED_CONV3, NO_CONV_STATE_HALF_ROTARY, WIDE_HEADS],
                         ids=["tiny", "grouped", "k1_half_rotary", "wide_heads"])
def test_it_follows_the_torch_layer(cfg):
    """The same products on both sides (the row kernel) and the delta kernel switched off on one
    side: the same greedy tokens, logits and state within float32 rounding."""
    ids = torch.randint(0, cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(4))
    native, torch_layer = Engine.from_config(cfg, max_seq_len=128), Engine.from_config(cfg, max_seq_len=128)
    for block in torch_layer.model.blocks:
        block.delta = None
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


def test_wrong_rows_are_refused_before_the_kernel_touches_the_state():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    before = engine.arena.buffer.clone()
    for block in engine.model.blocks:
        if block.delta is None:
            continue
        width = block.in_proj.w.shape[1]
        for row in (torch.zeros(1, 5), torch.zeros(1, width, dtype=torch.float64), torch.zeros(0, width)):
            with pytest.raises(ValueError, match="float32 CPU rows of"):
                block.delta(row)
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


def test_journals_record_it_and_refuse_another_version():
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    recorded = session_of(engine, "", 0)
    assert dict(recorded.kernels)["delta_step"] == delta_step.version() != ""
    assert all(b.delta is not None for b in engine_for(recorded).model.blocks if b.kind == "linear_attention")
    with pytest.raises(InvalidArgument, match="delta_step kernel '0'.*may round differently"):
        engine_for(replace(recorded, kernels=tuple((k, "0" if k == "delta_step" else v) for k, v in recorded.kernels)))
    with pytest.raises(InvalidArgument, match="delta_step kernel ''"):
        engine_for(replace(recorded, kernels=tuple((k, v) for k, v in recorded.kernels if k != "delta_step")))
