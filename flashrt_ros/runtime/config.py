"""Model configuration for the Qwen3.5-style hybrid decoder, dense or mixture of experts.

Field names follow the Hugging Face ``config.json`` of Qwen3.5 text models (dense and MoE)
so that a reader can hold the two side by side; nothing from ``transformers``
is imported or kept.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument, shown

LINEAR = "linear_attention"
FULL = "full_attention"

_SUPPORTED_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
_LATER_TYPES = ("qwen3_next",)
# A multimodal config's type -> the type of the text model it holds in ``text_config``.
_TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
MOE_TEXT = "qwen3_5_moe_text"
# Fields a dense model leaves at 0; left out of a dense model's fingerprint, so that adding
# them kept every dense capsule's model fingerprint.
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")


def _interleaved_layer_types(num_layers: int, full_every: int) -> tuple[str, ...]:
    return tuple(FULL if (i + 1) % full_every == 0 else LINEAR for i in range(num_layers))


def _json_bool(value: Any, key: str) -> bool:
    """A JSON true/false: bool("false") would be True, and tie the embeddings unasked."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"config {key} must be true or false, got {value!r:.40}")
    return value


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1
    obs_dim: int = 0
    action_dim: int = 0
    eos_token_ids: tuple[int, ...] = field(default=())
    # Mixture of experts (every layer's FFN, the MTP layer's too): num_experts = 0 is a dense
    # model, whose FFN is intermediate_size wide; an MoE model has no dense FFN (intermediate_size
    # = 0) and routes each token to num_experts_per_tok experts, plus a shared expert (width 0: none).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        positive = (
            "vocab_size", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
            "max_position_embeddings",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidArgument(f"config field {name} must be a positive int, got {value!r}")
        if not self.layer_types:
            raise InvalidArgument("config needs at least one layer (layer_types is empty)")
        unknown = sorted(set(self.layer_types) - {LINEAR, FULL})
        if unknown:
            raise InvalidArgument(f"unknown layer types {unknown}; expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidArgument(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise InvalidArgument(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise InvalidArgument(
                f"partial_rotary_factor={self.partial_rotary_factor} gives rotary dim {self.rotary_dim} "
                f"for head_dim={self.head_dim}; it must be even and in (0, head_dim]")
        if self.mtp_num_hidden_layers not in (0, 1):
            raise InvalidArgument(
                f"mtp_num_hidden_layers={self.mtp_num_hidden_layers} is not supported (0 or 1)")
        self._check_ffn()
        for name in ("obs_dim", "action_dim", "mtp_num_hidden_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidArgument(f"config field {name} must be an int, got {value!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            value = getattr(self, name)   # NaN or infinity here gives NaN (or zero) logits, silently
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise InvalidArgument(f"config field {name} must be a finite number > 0, got {value!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                   for t in self.eos_token_ids):
            raise InvalidArgument(f"eos_token_ids must be token ids below vocab_size, got {self.eos_token_ids!r}")
        if self.obs_dim < 0 or self.action_dim < 0 or (self.obs_dim == 0) != (self.action_dim == 0):
            raise InvalidArgument(
                f"policy mode needs obs_dim and action_dim both > 0 (or both 0 to turn it off), "
                f"got obs_dim={self.obs_dim}, action_dim={self.action_dim}")

    def _check_ffn(self) -> None:
        for name in ("intermediate_size",) + MOE_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"config field {name} must be an int >= 0, got {value!r}")
        if not self.moe:
            if self.intermediate_size == 0 or any(getattr(self, name) for name in MOE_FIELDS[1:]):
                raise InvalidArgument(
                    f"a dense model (num_experts=0) needs intermediate_size > 0 and no expert sizes, got "
                    f"intermediate_size={self.intermediate_size}, "
                    + ", ".join(f"{n}={getattr(self, n)}" for n in MOE_FIELDS[1:]))
            return
        if self.intermediate_size:
            raise InvalidArgument(f"an MoE model has no dense FFN: intermediate_size must be 0, "
                                  f"got {self.intermediate_size}")
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise InvalidArgument(f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                                  f"[1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size < 1:
            raise InvalidArgument(f"moe_intermediate_size must be > 0, got {self.moe_intermediate_size}")

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def moe(self) -> bool:
        """Whether every layer's FFN is a sparse MoE block."""
        return self.num_experts > 0

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def policy(self) -> bool:
        return self.obs_dim > 0

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def tiny(cls, **overrides: Any) -> "ModelConfig":
        """The embedded default: ~1M parameters, byte-level vocabulary (256 bytes + 4 specials)."""
        base = dict(
            vocab_size=260, hidden_size=128, intermediate_size=256,
            layer_types=_interleaved_layer_types(4, 4),
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=32, linear_value_head_dim=32,
            rope_theta=10_000.0, max_position_embeddings=32768, eos_token_ids=(257,),
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def bench(cls, **overrides: Any) -> "ModelConfig":
        """About 60M parameters: hidden 512, 8 layers at 3 linear : 1 full, for benchmarks."""
        base = dict(
            vocab_size=32768, hidden_size=512, intermediate_size=1536,
            layer_types=_interleaved_layer_types(8, 4),
            num_attention_heads=8, num_key_value_heads=2, head_dim=64,
            linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=64, linear_value_head_dim=64,
            max_position_embeddings=32768,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def from_hf_config(cls, raw: dict[str, Any]) -> "ModelConfig":
        """Parse a Hugging Face ``config.json`` dict of a Qwen3.5 text model, dense
        (``qwen3_5_text``) or mixture of experts (``qwen3_5_moe_text``).

        A multimodal ``qwen3_5`` or ``qwen3_5_moe`` checkpoint is accepted through its ``text_config``.
        """
        if not isinstance(raw, dict):
            raise InvalidArgument(f"config must be a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type in _LATER_TYPES:
            raise InvalidArgument(
                f"model_type {model_type!r} (Qwen3-Next) is not supported yet; "
                f"supported: {', '.join(_SUPPORTED_TYPES)}")
        if model_type not in _SUPPORTED_TYPES:
            raise InvalidArgument(
                f"unsupported model_type {model_type!r}; supported: {', '.join(_SUPPORTED_TYPES)}")
        text = raw
        if model_type in _TEXT_TYPES:
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise InvalidArgument(f"{model_type} config has no text_config object")
            if text.get("model_type", _TEXT_TYPES[model_type]) != _TEXT_TYPES[model_type]:
                return cls.from_hf_config(text)
            model_type = _TEXT_TYPES[model_type]
        if raw.get("quantization_config") or text.get("quantization_config"):
            raise InvalidArgument("quantized checkpoints (quantization_config) are not supported: "
                                  "load the float16, bfloat16 or float32 release")
        try:
            return cls._from_text(raw, text, moe=model_type == MOE_TEXT)
        except InvalidArgument:
            raise
        except (TypeError, ValueError, AttributeError, ZeroDivisionError) as exc:  # a list where an int belongs
            raise InvalidArgument(f"malformed config: {type(exc).__name__}: {exc}") from None

    @classmethod
    def _from_text(cls, raw: dict[str, Any], text: dict[str, Any], moe: bool) -> "ModelConfig":
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise InvalidArgument(f"rope_type {rope_type!r} is not supported (only 'default')")
        if text.get("hidden_act", "silu") != "silu":
            raise InvalidArgument(f"hidden_act {text.get('hidden_act')!r} is not supported (only 'silu')")
        if text.get("attention_bias", False):
            raise InvalidArgument("attention_bias=true is not supported by this runtime")

        num_layers = text.get("num_hidden_layers")
        layer_types = text.get("layer_types")
        if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                       or num_layers < 1):
            raise InvalidArgument(f"num_hidden_layers must be a positive int, got {shown(num_layers)}")
        if layer_types is None:
            if num_layers is None:
                raise InvalidArgument("config needs num_hidden_layers or layer_types")
            interval = text.get("full_attention_interval", 4)
            if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
                raise InvalidArgument(f"full_attention_interval must be a positive int, got {shown(interval)}")
            layer_types = _interleaved_layer_types(num_layers, interval)
        layer_types = tuple(layer_types)
        if num_layers is not None and num_layers != len(layer_types):
            raise InvalidArgument(
                f"num_hidden_layers={num_layers} but layer_types lists {len(layer_types)} layers")

        if (text.get("mtp_num_hidden_layers", 1) != 0
                and _json_bool(text.get("mtp_use_dedicated_embeddings", False), "mtp_use_dedicated_embeddings")):
            raise InvalidArgument("mtp_use_dedicated_embeddings=true is not supported: this MTP layer reads the "
                                  "model's own token embedding (every dense Qwen3.5 release sets it false)")
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))   # checked as ids
        hidden = _required(text, "hidden_size")
        heads = _required(text, "num_attention_heads")
        return cls(
            vocab_size=_required(text, "vocab_size"),
            hidden_size=hidden,
            # transformers' MoE config has no dense FFN width (a stray one there is unused).
            intermediate_size=0 if moe else _required(text, "intermediate_size"),
            layer_types=layer_types,
            num_attention_heads=heads,
            # Fields transformers' Qwen3_5TextConfig gives a default get the same one here,
            # so a config.json it loads describes the same model; the sizes above have
            # defaults there too (a 9B model's) but are required: a mistake, not a choice.
            num_key_value_heads=text.get("num_key_value_heads", 4),
            head_dim=text.get("head_dim", 256),
            linear_num_key_heads=text.get("linear_num_key_heads", 16),
            linear_num_value_heads=text.get("linear_num_value_heads", 32),
            linear_key_head_dim=text.get("linear_key_head_dim", 128),
            linear_value_head_dim=text.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10_000.0))),
            partial_rotary_factor=float(
                rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
            max_position_embeddings=text.get("max_position_embeddings", 32768),
            tie_word_embeddings=_json_bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
                                           "tie_word_embeddings"),
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 1),
            obs_dim=text.get("obs_dim", 0),
            action_dim=text.get("action_dim", 0),
            eos_token_ids=eos_ids,
            **(_moe_fields(text) if moe else {}),
        )

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except OSError as exc:
            raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
        except ValueError as exc:   # not JSON, or not UTF-8
            raise InvalidArgument(f"{path} is not valid JSON: {exc}") from None
        return cls.from_hf_config(raw)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that ``transformers`` loads as ``Qwen3_5ForCausalLM``
        (``Qwen3_5MoeForCausalLM`` for an MoE model)."""
        out: dict[str, Any] = {
            "architectures": ["Qwen3_5MoeForCausalLM" if self.moe else "Qwen3_5ForCausalLM"],
            "model_type": MOE_TEXT if self.moe else "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            **({name: getattr(self, name) for name in MOE_FIELDS} if self.moe
               else {"intermediate_size": self.intermediate_size}),
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
        }
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids)
        if self.policy:
            out["obs_dim"], out["action_dim"] = self.obs_dim, self.action_dim
        return out

    def fingerprint(self) -> str:
        fields = dataclasses.asdict(self)
        if not self.moe:
            for name in MOE_FIELDS:
                del fields[name]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16).hexdigest()


def _required(raw: dict[str, Any], key: str) -> Any:
    if key not in raw:
        raise InvalidArgument(f"config is missing required field {key!r}")
    return raw[key]


def _moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The expert sizes of a ``qwen3_5_moe_text`` config (all required: a size is never a default).
    transformers' Qwen3.5 MoE router always renormalises its top-k weights (its config has no
    ``norm_topk_prob``); a config that asks for raw softmax weights names another model."""
    if text.get("norm_topk_prob", True) is not True:
        raise InvalidArgument(f"norm_topk_prob={text['norm_topk_prob']!r} is not supported: a Qwen3.5 MoE "
                              f"router renormalises its top-k weights (as transformers computes it)")
    return {name: _required(text, name) for name in MOE_FIELDS}
