"""The engine reproduces transformers' Qwen3.5 MoE models on the same checkpoint (fp32): prefill
and stepwise decode, on each way the experts run, from each layout a checkpoint stores them in."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashrt_ros.errors import CheckpointError
from flashrt_ros.runtime import Engine
from flashrt_ros.runtime.weights import kept_bytes, save_checkpoint, seeded_weights
from hf_reference import MOE_CONFIGS, save_hf_model

TOL = 1e-4
STEPS = 32
# How a decode step runs its experts: grouped by expert with the C row kernel (a CPU's default)
# or torch's products, or gathered by index with fixed shapes (what a CUDA graph captures).
DECODE_PATHS = {"grouped_c_kernels": dict(cpu_kernels=True), "grouped_torch": dict(cpu_kernels=False),
                "gathered_fixed_shapes": dict(static_shapes=True)}


@pytest.fixture(scope="module", params=sorted(MOE_CONFIGS))
def pair(request, tmp_path_factory):
    cfg = MOE_CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    return save_hf_model(cfg, seed=0, path=path), path


def _prefill_error(hf, engine: Engine, length: int, seed: int) -> float:
    ids = torch.randint(0, engine.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    ours = engine.prefill(ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    return (ours - ref).abs().max().item()


def _stepwise(hf, engine: Engine, prompt: int = 40) -> tuple[float, list[int], list[int]]:
    """(worst logit difference over the prefill and STEPS decode steps, our tokens, transformers')."""
    ids = torch.randint(0, engine.config.vocab_size, (prompt,), generator=torch.Generator().manual_seed(3))
    ours_logits, ours_tokens = [engine.prefill(ids)], []
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones(1, prompt, dtype=torch.long), max_new_tokens=STEPS,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          eos_token_id=None, pad_token_id=0)
    for _ in range(STEPS):
        ours_tokens += engine.generate(1)
        ours_logits.append(engine.logits())
    worst = max((ours - ref[0]).abs().max().item() for ours, ref in zip(ours_logits, out.logits))
    return worst, ours_tokens, out.sequences[0, prompt:].tolist()


@pytest.mark.parametrize("native", [True, False], ids=["c_kernels", "torch"])
@pytest.mark.parametrize("length", [1, 65, 200])
def test_prefill_logits_match_transformers(pair, length, native):
    hf, path = pair
    error = _prefill_error(hf, Engine.from_pretrained(path, cpu_kernels=native), length, seed=length)
    print(f"{path.name} prefill {length} {'c_kernels' if native else 'torch'}: logit difference {error:.2e}")
    assert error < TOL


@pytest.mark.parametrize("path_name", sorted(DECODE_PATHS))
def test_stepwise_decode_logits_and_greedy_tokens_match_transformers(pair, path_name):
    hf, path = pair
    worst, ours, ref = _stepwise(hf, Engine.from_pretrained(path, **DECODE_PATHS[path_name]))
    print(f"{path.name} {path_name}: worst logit difference {worst:.2e} over {STEPS + 1} positions, "
          f"{STEPS} greedy tokens identical: {ours == ref}")
    assert ours == ref
    assert worst < TOL


def test_a_decode_step_runs_only_the_routed_experts(pair, monkeypatch):
    """On a CPU, each layer's step multiplies by the k experts its router chose and no other."""
    from flashrt_ros.runtime.projection import Projection

    hf, path = pair
    engine = Engine.from_pretrained(path)
    engine.prefill([1, 2, 3])
    experts = {id(p) for p in engine.model.expert_projections()}
    called = []
    real = Projection.__call__
    monkeypatch.setattr(Projection, "__call__", lambda p, x: called.append(id(p) in experts) or real(p, x))
    engine.generate(1)
    cfg = engine.config
    assert sum(called) == 2 * cfg.num_experts_per_tok * cfg.num_hidden_layers


@pytest.mark.parametrize("layout", ["fused", "multimodal", "sharded"])
def test_each_checkpoint_layout_loads_the_same_model(layout, tmp_path):
    """transformers' fused expert tensors (save_original_format=False), a Qwen3_5MoeForConditionalGeneration
    checkpoint (model.language_model.*, a vision tower left aside), and per-expert shards."""
    cfg = MOE_CONFIGS["e8_top2_shared"]
    kwargs = {"fused": dict(save_original_format=False), "multimodal": dict(multimodal=True),
              "sharded": dict(max_shard_size="100KB")}[layout]
    hf = save_hf_model(cfg, seed=4, path=tmp_path, **kwargs)
    names = [n for f in tmp_path.glob("*.safetensors") for n in safe_open(f, "pt").keys()]
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in names) == (layout == "fused")
    assert any(n.startswith("model.language_model.") for n in names) == (layout == "multimodal")
    engine = Engine.from_pretrained(tmp_path)
    assert engine.config.moe and engine.config.num_experts == 8
    if layout != "multimodal":   # its text forward: the engine's tokens and logits alike
        assert _prefill_error(hf, engine, 30, seed=1) < TOL
        return
    worst, ours, ref = _stepwise(hf, engine)
    assert ours == ref and worst < TOL


def test_the_mtp_layers_moe_block_loads_and_computes_as_transformers_block(tmp_path):
    """A released checkpoint's MTP layer is an MoE layer, stored per expert like the others:
    it loads (nothing seeded), and its block computes what transformers' block computes."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = MOE_CONFIGS["e12_top3_shared"]
    weights = seeded_weights(cfg, seed=2)
    stored = {}
    for name, t in weights.items():   # the released layout: per-expert matrices, a multimodal prefix
        name = name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.chunk(2, dim=1)
            for e in range(cfg.num_experts):
                stored[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e].contiguous()
                stored[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e].contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(cfg.num_experts):
                stored[name.replace("down_proj", f"{e}.down_proj.weight")] = t[e].contiguous()
        else:
            stored[name] = t
    stored["model.visual.patch_embed.proj.weight"] = torch.ones(64, 48)   # a vision tower's, never loaded
    save_file(stored, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": cfg.to_hf_config()}))
    engine = Engine.from_pretrained(tmp_path)
    assert engine.seeded_weights == ()
    assert engine.model_fingerprint == Engine(cfg, weights).model_fingerprint
    assert kept_bytes(tmp_path, cfg) == sum(t.numel() * t.element_size() for t in weights.values())

    fields = {k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures", "model_type")}
    block = Qwen3_5MoeSparseMoeBlock(Qwen3_5MoeTextConfig(**fields)).eval()
    block.load_state_dict({k[len("mtp.layers.0.mlp."):]: v for k, v in weights.items()
                           if k.startswith("mtp.layers.0.mlp.")})
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = block(x[None])[0]
    mlp = engine.model.mtp.mlp
    for fixed in (False, True):
        assert (mlp(x, fixed=fixed) - ref).abs().max().item() < 1e-5


def test_a_checkpoint_missing_one_experts_matrix_is_refused_by_name(tmp_path):
    cfg = MOE_CONFIGS["e8_top2_shared"]
    save_hf_model(cfg, seed=1, path=tmp_path)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks some experts' tensors under model\.layers\.2\.mlp\.experts"):
        Engine.from_pretrained(tmp_path)


def test_seeded_moe_weights_save_and_load_as_a_checkpoint(tmp_path):
    cfg = MOE_CONFIGS["e16_top4_no_shared_odd_tied"]
    weights = seeded_weights(cfg, seed=3)
    save_checkpoint(tmp_path, cfg, weights)
    loaded, built = Engine.from_pretrained(tmp_path), Engine(cfg, weights)
    assert loaded.seeded_weights == () and loaded.model_fingerprint == built.model_fingerprint
    loaded.prefill([5, 6, 7])
    built.prefill([5, 6, 7])
    assert loaded.generate(12) == built.generate(12)

