"""Test helper: random ``transformers`` Qwen3.5 models saved as real checkpoints."""
from __future__ import annotations

import warnings
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

# Random transformers-built MoE models: 8 to 16 experts, 2 to 4 routed per token, with a shared
# expert and without one (width 0), odd sizes, tied embeddings, a full-attention layer first.
MOE_CONFIGS = {
    "e8_top2_shared": ModelConfig.tiny(
        vocab_size=300, intermediate_size=0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, shared_expert_intermediate_size=64),
    "e16_top4_no_shared_odd_tied": ModelConfig.tiny(
        vocab_size=317, hidden_size=72, intermediate_size=0,
        layer_types=("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"),
        num_attention_heads=3, num_key_value_heads=1, head_dim=24,
        linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=20, linear_value_head_dim=12,
        linear_conv_kernel_dim=3, tie_word_embeddings=True,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=20, shared_expert_intermediate_size=0),
    "e12_top3_shared": ModelConfig.tiny(
        vocab_size=280, hidden_size=64, intermediate_size=0,
        layer_types=("linear_attention",) * 3 + ("full_attention",) * 2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5,
        num_experts=12, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40),
}

_NOT_HF_FIELDS = ("architectures", "model_type", "mtp_num_hidden_layers", "obs_dim", "action_dim")


def build_hf_model(cfg: ModelConfig, seed: int, multimodal: bool = False):
    """A ``Qwen3_5ForCausalLM`` (``Qwen3_5MoeForCausalLM`` for an MoE config; with ``multimodal``,
    ``Qwen3_5MoeForConditionalGeneration`` with a small vision tower) with every parameter
    randomised (transformers zero-inits the norms)."""
    import transformers

    transformers.logging.set_verbosity_error()  # it warns that fla/causal_conv1d kernels are absent
    # A shared expert of width 0 is zero-size matrices, whose init torch calls a no-op.
    warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")

    fields = {k: v for k, v in cfg.to_hf_config().items() if k not in _NOT_HF_FIELDS}
    if multimodal:
        vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                  "out_hidden_size": cfg.hidden_size}
        hf_cfg = transformers.Qwen3_5MoeConfig(text_config=fields, vision_config=vision,
                                               tie_word_embeddings=cfg.tie_word_embeddings)
        model = transformers.Qwen3_5MoeForConditionalGeneration(hf_cfg).eval()
    elif cfg.moe:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**fields)).eval()
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields)).eval()
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


def save_hf_model(cfg: ModelConfig, seed: int, path: Path, multimodal: bool = False, **save_kwargs):
    model = build_hf_model(cfg, seed, multimodal)
    model.save_pretrained(path, **save_kwargs)
    return model
