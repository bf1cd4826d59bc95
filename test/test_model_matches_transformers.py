"""The engine reproduces transformers' Qwen3_5ForCausalLM on the same checkpoint (fp32)."""
from __future__ import annotations

import pytest
import torch

from flashrt_ros.runtime import Engine, ModelConfig
from hf_reference import CONFIGS, save_hf_model

TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hf_model(cfg, seed=0, path=path)
    return hf, path


def _prefill_error(hf, engine: Engine, length: int, seed: int) -> float:
    """Max abs difference of the last-position logits after prefilling the same random prompt."""
    ids = torch.randint(0, engine.config.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    ours = engine.prefill(ids)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0, -1]
    return (ours - ref).abs().max().item()


# Both prefill paths: on a CPU in fp32 the C library runs the linear-attention layers token after
# token; the torch path (and a GPU) runs the chunked form, whose chunks these lengths cross.
PREFILL_PATHS = pytest.mark.parametrize("native", [True, False], ids=["c_kernels", "torch_chunked"])


@PREFILL_PATHS
@pytest.mark.parametrize("length", [1, 63, 64, 65, 300])
def test_prefill_logits_match_transformers(pair, length, native):
    hf, path = pair
    engine = Engine.from_pretrained(path, cpu_kernels=native)
    assert engine.cpu_kernels == native
    assert _prefill_error(hf, engine, length, seed=length) < TOL


@PREFILL_PATHS
def test_prefill_in_unaligned_chunks_matches_transformers(pair, native):
    hf, path = pair
    assert _prefill_error(hf, Engine.from_pretrained(path, prefill_chunk=100, cpu_kernels=native), 300, seed=7) < TOL


@pytest.mark.parametrize("native", [True, False], ids=["c_kernels", "torch"])
def test_stepwise_decode_logits_and_greedy_tokens_match_transformers(pair, native):
    """Both decode paths: the C library's (the CPU default) and torch's (what a CUDA graph captures)."""
    hf, path = pair
    engine = Engine.from_pretrained(path, cpu_kernels=native)
    assert engine.cpu_kernels == native and all((b.delta is not None) == native for b in engine.model.blocks
                                                 if b.kind == "linear_attention")
    ids = torch.randint(0, engine.config.vocab_size, (70,), generator=torch.Generator().manual_seed(3))
    first = engine.prefill(ids)
    with torch.no_grad():
        out = hf.generate(ids[None], attention_mask=torch.ones(1, 70, dtype=torch.long), max_new_tokens=64,
                          do_sample=False, output_logits=True, return_dict_in_generate=True,
                          eos_token_id=None, pad_token_id=0)
    ref_tokens = out.sequences[0, 70:].tolist()
    ours_logits, ours_tokens = [first], []
    for _ in range(64):
        ours_tokens += engine.generate(1)
        ours_logits.append(engine.logits())
    assert ours_tokens == ref_tokens
    for step, ref in enumerate(out.logits):
        assert (ours_logits[step] - ref[0]).abs().max().item() < TOL, f"decode step {step}"


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _partial_rope(x: torch.Tensor, positions: torch.Tensor, rot: int, theta: float) -> torch.Tensor:
    freqs = positions[:, None].double() / theta ** (torch.arange(0, rot, 2).double() / rot)
    cos, sin = freqs.cos().float()[:, None], freqs.sin().float()[:, None]
    a, b, rest = x[..., :rot // 2], x[..., rot // 2:rot], x[..., rot:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)


def test_mtp_kv_rows_are_the_mtp_layers_keys_and_values_from_the_reference_hidden_states(tmp_path):
    """The MTP layer's K/V rows, written from the definition (HF key names, transformers'
    final hidden states): row t pairs token t's embedding with the hidden state of t-1."""
    from safetensors.torch import load_file

    from flashrt_ros.runtime.weights import save_checkpoint, seeded_weights

    cfg = ModelConfig.tiny(vocab_size=300)
    save_checkpoint(tmp_path, cfg, seeded_weights(cfg, seed=5))
    engine = Engine.from_pretrained(tmp_path)
    ids = torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    engine.prefill(ids)
    ids += engine.generate(6)  # decode rows too

    import transformers
    transformers.logging.set_verbosity_error()
    hf = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    w = load_file(tmp_path / "model.safetensors")
    eps, hkv, d = cfg.rms_norm_eps, cfg.num_key_value_heads, cfg.head_dim
    prev = torch.cat([torch.zeros(1, cfg.hidden_size), hidden[:-1]])
    m = torch.cat([_rms(w["model.embed_tokens.weight"][ids], w["mtp.pre_fc_norm_embedding.weight"], eps),
                   _rms(prev, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].t()
    h = _rms(m, w["mtp.layers.0.input_layernorm.weight"], eps)
    a = "mtp.layers.0.self_attn."
    k = _rms((h @ w[f"{a}k_proj.weight"].t()).view(-1, hkv, d), w[f"{a}k_norm.weight"], eps)
    k = _partial_rope(k, torch.arange(len(ids)), cfg.rotary_dim, cfg.rope_theta)
    v = (h @ w[f"{a}v_proj.weight"].t()).view(-1, hkv, d)
    rows = engine.arena["mtp.kv"][:len(ids)]
    assert (rows[:, 0] - k).abs().max() < 1e-4
    assert (rows[:, 1] - v).abs().max() < 1e-4
