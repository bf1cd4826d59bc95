"""The released Qwen3.5 / Qwen3.6 text models' shapes, as their checkpoints' ``text_config`` gives
them, and what their execution state takes.

The values were read from copies of the checkpoints' config.json, not from the checkpoints
(this project cannot reach the hub); where each comes from is in ``SOURCES``. Every model has
``linear_key_head_dim`` = ``linear_value_head_dim`` = 128, ``linear_conv_kernel_dim`` = 4,
``full_attention_interval`` = 4, ``head_dim`` = 256, ``partial_rotary_factor`` = 0.25 and a
vocabulary of 248,320. Qwen3.5-2B's tied embeddings and MTP layer were found in no source: they
are taken as the other small models have them (neither changes the state's size).

The router of an MoE model has no state: its state is that of its dense twin (``state_config``).
"""
from __future__ import annotations

from typing import Any

import torch

from .config import ModelConfig
from .models.qwen35 import state_specs
from .weights import expected_shapes

_COMMON = {"model_type": "qwen3_5_text", "head_dim": 256, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "vocab_size": 248320,
           "mtp_num_hidden_layers": 1, "max_position_embeddings": 262144,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}}


def _model(hidden: int, layers: int, heads: int, kv_heads: int, linear_k: int, linear_v: int, ffn: int,
           tied: bool, **moe: int) -> dict[str, Any]:
    return _COMMON | {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                      "num_key_value_heads": kv_heads, "linear_num_key_heads": linear_k,
                      "linear_num_value_heads": linear_v, "intermediate_size": ffn, "tie_word_embeddings": tied,
                      **moe}


RELEASED: dict[str, dict[str, Any]] = {
    "Qwen3.5-0.8B": _model(1024, 24, 8, 2, 16, 16, 3584, tied=True),
    "Qwen3.5-2B": _model(2048, 24, 8, 2, 16, 16, 6144, tied=True),
    "Qwen3.5-4B": _model(2560, 32, 16, 4, 16, 32, 9216, tied=True),
    "Qwen3.5-9B": _model(4096, 32, 16, 4, 16, 32, 12288, tied=False),
    "Qwen3.5-27B": _model(5120, 64, 24, 4, 16, 48, 17408, tied=False),
    # Qwen3.6-35B-A3B has the same text model. No dense FFN: every layer's MLP is 256 experts
    # of 512, 8 routed per token, plus one shared expert of 512.
    "Qwen3.5-35B-A3B": _model(2048, 40, 16, 2, 16, 32, 0, tied=False, num_experts=256, num_experts_per_tok=8,
                              moe_intermediate_size=512, shared_expert_intermediate_size=512),
}

SOURCES = {
    "Qwen3.5-0.8B": "THUDM/slime scripts/models/qwen3.5-0.8B.sh @624b824a; a quoted Qwen/Qwen3.5-0.8B@2fc06364 "
                    "config.json; cpehle/tyr Tyr/Model/Qwen35/Config.lean @1651c71b",
    "Qwen3.5-2B": "a test reading sample/Qwen/Qwen3.5-2B/config.json; ggml-org/llama.cpp src/models/qwen35.cpp "
                  "@06e514f6 (24 layers); tied embeddings and MTP layer not found",
    "Qwen3.5-4B": "THUDM/slime scripts/models/qwen3.5-4B.sh @624b824a; vllm-project/vllm-metal "
                  "tests/test_hybrid_model_dims.py @2d0cad89 (from Qwen/Qwen3.5-4B config.json)",
    "Qwen3.5-9B": "THUDM/slime scripts/models/qwen3.5-9B.sh @624b824a; huggingface/transformers "
                  "models/qwen3_5/configuration_qwen3_5.py @008e5743 (defaults 'Qwen3.5-9B style')",
    "Qwen3.5-27B": "THUDM/slime scripts/models/qwen3.5-27B.sh @624b824a; NVIDIA-NeMo/Megatron-Bridge "
                   "qwen35_vl_provider.py @067f987d; the Qwen/Qwen3.5-27B model card",
    "Qwen3.5-35B-A3B": "flashrt-project/FlashRT flash_rt/frontends/torch/qwen36_moe.py @e33faa58 (checked against "
                       "the Qwen3.6-35B-A3B checkpoint); THUDM/slime scripts/models/qwen3.5-35B-A3B.sh; "
                       "transformers configuration_qwen3_5_moe.py @008e5743",
}


def state_config(text: dict[str, Any]) -> ModelConfig:
    """The ModelConfig whose state is the model's: an MoE model's dense twin (its shared
    expert's width as the FFN, which the state does not depend on)."""
    dense = {k: v for k, v in text.items() if not k.startswith(("num_experts", "moe_", "shared_expert"))}
    if "num_experts" in text:
        dense["intermediate_size"] = text["shared_expert_intermediate_size"]
    return ModelConfig.from_hf_config(dense)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(fixed, per token) bytes of the arena: what every capsule holds, and what each position adds."""
    fixed = per_token = 0
    for spec in state_specs(cfg, 1, dtype):
        size = torch.Size(spec.shape).numel() * torch.empty((), dtype=spec.dtype).element_size()
        if spec.per_token:
            per_token += size
        else:
            fixed += size
    return fixed, per_token


def parameters(text: dict[str, Any]) -> int:
    """The model's parameter count: its dense twin's, plus each MoE layer's routed experts and
    gates (the MTP layer is an MoE layer too) in place of the twin's FFN, which is the shared expert."""
    cfg = state_config(text)
    count = sum(torch.Size(shape).numel() for shape in expected_shapes(cfg).values())
    if "num_experts" in text:
        hidden, experts = text["hidden_size"], text["num_experts"]
        per_layer = experts * 3 * hidden * text["moe_intermediate_size"] + hidden * experts + hidden
        count += (text["num_hidden_layers"] + text.get("mtp_num_hidden_layers", 0)) * per_layer
    return count
