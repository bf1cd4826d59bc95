"""Test helper: random ``transformers`` Qwen3.5 models saved as real checkpoints."""
from __future__ import annotations

from pathlib import Path

import torch

from flashrt_ros.runtime import ModelConfig

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
