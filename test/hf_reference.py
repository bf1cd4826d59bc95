"""Test helper: random ``transformers`` Qwen3.5 models saved as real checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

from flashrt_ros.runtime import ModelConfig

# Random transformers-built models the engine is checked against: GQA, odd sizes with tied
# embeddings and a full-attention layer first, no conv state, and products wide enough to split
# over threads.
CONFIGS = {
    "3linear_1full_gqa": ModelConfig.tiny(vocab_size=300),
    "full_first_odd_sizes_tied": ModelConfig.tiny(
        vocab_size=317, hidden_size=72, intermediate_size=100,
        layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"),
        num_attention_heads=3, num_key_value_heads=1, head_dim=24,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=20, linear_value_head_dim=12,
        linear_conv_kernel_dim=3, tie_word_embeddings=True),
    "mha_equal_linear_heads_half_rotary_conv1": ModelConfig.tiny(
        vocab_size=280, hidden_size=64, intermediate_size=96,
        layer_types=("linear_attention",) * 5 + ("full_attention",),
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=32,
        linear_conv_kernel_dim=1),   # no conv state at all: its window slicing must still hold
    # Projections of 512 KiB and more: wide enough that the products split their work over threads.
    "wide": ModelConfig.tiny(vocab_size=300, hidden_size=512, intermediate_size=1024),
}

_NOT_HF_FIELDS = ("architectures", "model_type", "mtp_num_hidden_layers", "obs_dim", "action_dim")


def build_hf_model(cfg: ModelConfig, seed: int):
    """A ``Qwen3_5ForCausalLM`` with every parameter randomised (transformers zero-inits the norms)."""
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    transformers.logging.set_verbosity_error()  # it warns that fla/causal_conv1d kernels are absent

    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_config().items() if k not in _NOT_HF_FIELDS})
    model = Qwen3_5ForCausalLM(hf_cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                # decays spread from short to long memory, as trained models have
                p.copy_(torch.empty(p.shape).uniform_(0.01, 1.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(0.5, 1.5, generator=gen))
            elif "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def save_hf_model(cfg: ModelConfig, seed: int, path: Path, **save_kwargs):
    model = build_hf_model(cfg, seed)
    model.save_pretrained(path, **save_kwargs)
    return model
