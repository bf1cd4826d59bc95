"""Weights: the names and shapes a config implies, seeded weights for the embedded
default, loading Hugging Face safetensors checkpoints, and the model fingerprint.

Weights travel as a flat ``{hf_name: tensor}`` dict in the Hugging Face naming
of ``Qwen3_5ForCausalLM`` (of ``Qwen3_5MoeForCausalLM`` for an MoE model, its experts
as transformers' fused ``gate_up_proj`` and ``down_proj`` stacks); the model fuses them
into its own layout only when it is built, so the fingerprint is independent of that layout.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from pathlib import Path

import torch
from blake3 import blake3
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, InvalidArgument
from . import inputs
from .config import FULL, ModelConfig
from .sampling import GREEDY, Sampling

log = logging.getLogger(__name__)

# Groups a checkpoint may omit; they are then seeded (flagged in the engine's info).
OPTIONAL_PREFIXES = ("mtp.", "policy.")
# Not a weight: the token ids an MTP head drafts over (``mtp_head``), kept with its tensors.
DRAFT_VOCAB = "mtp.draft_vocab"
# Prefixes of multimodal checkpoints mapped onto the text model, or ignored.
_RENAMES = (("model.language_model.", "model."),)
_IGNORED = ("model.visual.", "visual.", "model.vision_tower.")


def _attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        f"{prefix}self_attn.q_proj.weight": (2 * cfg.num_attention_heads * d, h),
        f"{prefix}self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{prefix}self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{prefix}self_attn.q_norm.weight": (d,),
        f"{prefix}self_attn.k_norm.weight": (d,),
    }


def _block_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    norms = {f"{prefix}input_layernorm.weight": (h,), f"{prefix}post_attention_layernorm.weight": (h,)}
    if cfg.moe:
        return norms | _moe_shapes(cfg, f"{prefix}mlp.")
    return norms | {
        f"{prefix}mlp.gate_proj.weight": (i, h),
        f"{prefix}mlp.up_proj.weight": (i, h),
        f"{prefix}mlp.down_proj.weight": (h, i),
    }


def _moe_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A sparse MoE block, its experts by transformers' fused names (a checkpoint's per-expert
    tensors are stacked into these as they load: ``ExpertStacks``). A shared expert of width 0
    (none) has no tensors here: transformers' zero-size ones carry nothing."""
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    shapes = {f"{p}gate.weight": (e, h), f"{p}experts.gate_up_proj": (e, 2 * i, h), f"{p}experts.down_proj": (e, h, i)}
    if s:
        shapes |= {f"{p}shared_expert.gate_proj.weight": (s, h), f"{p}shared_expert.up_proj.weight": (s, h),
                   f"{p}shared_expert.down_proj.weight": (h, s), f"{p}shared_expert_gate.weight": (1, h)}
    return shapes


# A released (and transformers-saved) MoE checkpoint stores each expert's matrices apart.
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ExpertStacks:
    """Per-expert tensors (``...mlp.experts.N.gate_proj.weight`` etc.) gathered into transformers'
    fused ones: ``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows) and
    ``down_proj`` [E, H, I]. A layer's stack is built as soon as its last part arrives and its
    parts dropped, so loading holds at most the layers still incomplete twice."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg
        self.parts: dict[str, dict[tuple[int, str], torch.Tensor]] = {}

    @staticmethod
    def matches(name: str) -> bool:
        return _PER_EXPERT.match(name) is not None

    def add(self, name: str, tensor: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
        """Take one part; returns the fused tensors it completes (by canonical name), or {}."""
        prefix, expert, kind = _PER_EXPERT.match(name).groups()
        e, h, i = self.cfg.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        shape = (h, i) if kind == "down_proj" else (i, h)
        if int(expert) >= e or tuple(tensor.shape) != shape:
            raise CheckpointError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, config implies "
                                  f"{shape} for experts 0..{e - 1}")
        parts = self.parts.setdefault(prefix, {})
        if (int(expert), kind) in parts:
            raise CheckpointError(f"{where}: tensor {name} is stored twice")
        parts[(int(expert), kind)] = tensor
        if len(parts) < 3 * e:
            return {}
        del self.parts[prefix]
        stack = [torch.cat([parts[(x, "gate_proj")], parts[(x, "up_proj")]]) for x in range(e)]
        return {f"{prefix}.gate_up_proj": torch.stack(stack),
                f"{prefix}.down_proj": torch.stack([parts[(x, "down_proj")] for x in range(e)])}

    def incomplete(self) -> list[str]:
        """The experts' prefixes some of whose parts never came."""
        return sorted(self.parts)


def _linear_attention_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    p = f"{prefix}linear_attn."
    return {
        f"{p}in_proj_qkv.weight": (cfg.conv_dim, h),
        f"{p}in_proj_z.weight": (cfg.linear_value_dim, h),
        f"{p}in_proj_b.weight": (hv, h),
        f"{p}in_proj_a.weight": (hv, h),
        f"{p}conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{p}dt_bias": (hv,),
        f"{p}A_log": (hv,),
        f"{p}norm.weight": (cfg.linear_value_head_dim,),
        f"{p}out_proj.weight": (h, cfg.linear_value_dim),
    }


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model needs, by Hugging Face name."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for idx, kind in enumerate(cfg.layer_types):
        prefix = f"model.layers.{idx}."
        shapes |= _block_shapes(cfg, prefix)
        shapes |= _attention_shapes(cfg, prefix) if kind == FULL else _linear_attention_shapes(cfg, prefix)
    if cfg.mtp_num_hidden_layers:
        shapes |= {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
                   "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
        shapes |= _block_shapes(cfg, "mtp.layers.0.") | _attention_shapes(cfg, "mtp.layers.0.")
    if cfg.policy:
        shapes |= {"policy.obs_proj.weight": (h, cfg.obs_dim), "policy.obs_proj.bias": (h,),
                   "policy.action_head.weight": (cfg.action_dim, h), "policy.action_head.bias": (cfg.action_dim,)}
    return shapes


def check_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """CheckpointError unless ``weights`` holds every tensor ``cfg`` implies, each a
    floating-point tensor of the implied shape (extra tensors are ignored)."""
    for name, shape in expected_shapes(cfg).items():
        tensor = weights.get(name)
        if tensor is None:
            raise CheckpointError(f"weights have no tensor {name}")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.element_size() < 2:
            raise CheckpointError(f"tensor {name} is {getattr(tensor, 'dtype', type(tensor).__name__)}; expected "
                                  f"float16, bfloat16, float32 or float64 (quantized weights are not supported)")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {tuple(tensor.shape)}, config implies {shape}")
        if not _finite(tensor.detach()):
            raise CheckpointError(f"tensor {name} holds NaN or infinity: every output would be NaN")


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite. A finite sum proves it (a NaN or an infinity makes the sum
    one), in one pass with nothing allocated; only a sum that overflowed is checked value by
    value, in slices: a whole-tensor mask of a large embedding would cost a GB on load."""
    if tensor.numel() == 0 or bool(torch.isfinite(tensor.sum())):
        return True
    return all(bool(torch.isfinite(part).all()) for part in tensor.reshape(-1).split(1 << 24))


def _unit_uniform(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Uniform on [-1, 1) in steps of 2**-23, from integer draws and exact float steps only.

    Not ``torch.randn``: drawn with it at torch's AVX2 kernels, the embedded default
    came out as different bytes on an AMD EPYC and an Intel Xeon (same torch), so a
    capsule or bag made on one was foreign to the other. Integer draws from the
    generator are the same everywhere; so are the conversion of an integer below
    2**24 and a scaling by a power of two, and every later step here is one IEEE
    operation.
    """
    bits = torch.randint(-(1 << 23), 1 << 23, shape, generator=gen, dtype=torch.int32)
    return bits.to(torch.float32) * 2.0 ** -23


def _seeded(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    # One generator per tensor, keyed by name: a tensor's values do not depend
    # on which other tensors exist, so adding a head never changes the backbone.
    key = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") & (2**63 - 1))
    unit = _unit_uniform(shape, gen)
    if name.endswith("A_log"):
        # A log-uniform on [0.01, 1): per-token decays exp(-A * softplus(.)) from ~0.3 to
        # ~0.99, so some heads forget fast and some remember long, and the recurrent state
        # carries meaning. Uniform in log space, so no log is taken (libm's may differ).
        return (unit - 1.0) * (-0.5 * math.log(0.01))
    if name.endswith("dt_bias"):
        return 1.0 + 0.5 * unit                      # on [0.5, 1.5)
    spread = math.sqrt(3.0) * unit                   # zero mean, unit variance
    if name.endswith("linear_attn.norm.weight"):  # plain weight, centred on one
        return 1.0 + 0.1 * spread
    if name.endswith("norm.weight") or name.endswith(".bias"):  # zero-centred norms and biases
        return 0.1 * spread
    if name == "model.embed_tokens.weight":
        return spread
    return spread / math.sqrt(shape[-1])   # conv1d's last dim is its kernel, a projection's its input


def seeded_weights(cfg: ModelConfig, seed: int = 0, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Deterministic fp32 weights for every name in ``names`` (default: all)."""
    shapes = expected_shapes(cfg)
    return {n: _seeded(n, shapes[n], seed) for n in (names if names is not None else shapes)}


def _canonical(name: str) -> str | None:
    if name.startswith(_IGNORED):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: the shards its index lists, else every
    ``*.safetensors`` file in it; CheckpointError where one is missing or lies outside it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: unreadable shard index ({exc})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        files = sorted({path / f for f in weight_map.values()})
        if not files:
            raise CheckpointError(f"{index}: weight_map lists no shard files")
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path}: no *.safetensors files")
    for f in files:
        if f.parent.resolve() != path.resolve():
            raise CheckpointError(f"{index}: shard {f.name!r} points outside the checkpoint folder")
        if not f.is_file():
            where = "listed in the index " if index.is_file() else ""
            raise CheckpointError(f"{path}: shard {f.name} {where}is missing or not a file")
    return files


def kept_bytes(path: str | Path, cfg: ModelConfig) -> int:
    """The bytes of a checkpoint folder's tensors that a load of ``cfg`` keeps, from the files'
    headers alone: a load never touches the others (a multimodal release's vision tower,
    tensors the config has no place for)."""
    shapes, total = expected_shapes(cfg), 0
    for file in weight_files(Path(path)):
        try:
            with open(file, "rb") as stream:
                header = json.loads(stream.read(int.from_bytes(stream.read(8), "little")))
            spans = [(name, info["data_offsets"]) for name, info in header.items() if name != "__metadata__"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{file}: unreadable safetensors header ({exc})") from None
        for raw_name, (start, end) in spans:
            name = _canonical(raw_name)
            if name is not None and (name in shapes or cfg.moe and ExpertStacks.matches(name)):
                total += end - start
    return total


def load_checkpoint(path: str | Path, seed: int = 0, policy_dims: tuple[int, int] | None = None,
                    ) -> tuple[ModelConfig, dict[str, torch.Tensor], list[str]]:
    """Read ``config.json`` and the safetensors weights of a Hugging Face checkpoint folder.

    Returns the config, fp32-or-stored-dtype weights by canonical name, and the
    names that were absent and seeded (only ``mtp.*`` and ``policy.*`` may be).
    ``policy_dims`` (obs_dim, action_dim) overrides the config's policy heads,
    e.g. to drive a language checkpoint from robot observations; heads stored
    with other sizes are then left out and new ones seeded.
    """
    path = Path(path)
    if not path.is_dir():
        hint = ("" if path.exists() else
                "; from_pretrained reads a local folder: download a Hub model into one first "
                "(e.g. `hf download Qwen/Qwen3.5-0.8B --local-dir DIR`)")
        raise CheckpointError(f"checkpoint {path} is not a folder{hint}")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path} has no config.json")
    cfg = ModelConfig.from_json(path / "config.json")
    replaced_heads = False
    if policy_dims is not None:
        if not (isinstance(policy_dims, (tuple, list)) and len(policy_dims) == 2
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in policy_dims)):
            raise InvalidArgument(f"policy_dims must be (obs_dim, action_dim), two ints >= 0, got {policy_dims!r}")
        stored = (cfg.obs_dim, cfg.action_dim)
        cfg = dataclasses.replace(cfg, obs_dim=int(policy_dims[0]), action_dim=int(policy_dims[1]))
        replaced_heads = stored != (cfg.obs_dim, cfg.action_dim)
    shapes = expected_shapes(cfg)
    weights: dict[str, torch.Tensor] = {}
    stacks = ExpertStacks(cfg)
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as reader:
                for raw_name in reader.keys():
                    name = _canonical(raw_name)
                    if name is None:
                        continue
                    if replaced_heads and name.startswith("policy."):
                        log.warning("policy_dims %s replaces the stored head %s: seeding a new one",
                                    tuple(policy_dims), raw_name)
                        continue
                    if cfg.moe and ExpertStacks.matches(name):
                        for fused, tensor in stacks.add(name, reader.get_tensor(raw_name), file.name).items():
                            _keep(weights, shapes, fused, tensor, file.name, path)
                        continue
                    if name not in shapes and name != DRAFT_VOCAB:
                        if not (cfg.tie_word_embeddings and name == "lm_head.weight") and not _empty_shared(cfg, name):
                            log.warning("ignoring unexpected tensor %s in %s", raw_name, file.name)
                        continue
                    _keep(weights, shapes, name, reader.get_tensor(raw_name), file.name, path, raw_name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read {file}: {exc}") from None
    if stacks.incomplete():
        raise CheckpointError(f"checkpoint {path} lacks some experts' tensors under "
                              f"{', '.join(stacks.incomplete()[:3])}")
    missing = [n for n in shapes if n not in weights]
    required = [n for n in missing if not n.startswith(OPTIONAL_PREFIXES)]
    if required:
        shown = ", ".join(required[:5]) + (f" and {len(required) - 5} more" if len(required) > 5 else "")
        raise CheckpointError(f"checkpoint {path} is missing {len(required)} tensors: {shown}")
    if any(n.startswith("mtp.") for n in missing):
        # transformers drops mtp.* when it loads a Qwen3.5 model, so a fine-tune it saved has none.
        log.warning("checkpoint %s has no mtp.* weights: the MTP layer runs on seeded ones (seed=%d); its KV "
                    "in the state is then no draft model's, and speculative decoding would draft poorly",
                    path, seed)
    if any(n.startswith("policy.") for n in missing):
        log.info("checkpoint %s has no policy heads; seeding them (seed=%d)", path, seed)
    if missing:
        weights |= seeded_weights(cfg, seed, missing)
    return cfg, weights, missing


def _keep(weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]], name: str, tensor: torch.Tensor,
          file: str, path: Path, raw_name: str | None = None) -> None:
    """Add one tensor by canonical name, refusing one stored twice or of another shape."""
    shown_name = raw_name or name
    if name not in shapes and name != DRAFT_VOCAB:   # stacked experts of a layer the config lacks
        log.warning("ignoring unexpected tensors %s in %s", shown_name, file)
        return
    if name in weights:   # in two shards, or under two names: which one is meant?
        raise CheckpointError(f"{file}: tensor {shown_name} is stored twice in {path}")
    if name != DRAFT_VOCAB and tuple(tensor.shape) != shapes[name]:
        raise CheckpointError(f"{file}: tensor {shown_name} has shape {tuple(tensor.shape)}, "
                              f"config implies {shapes[name]}")
    weights[name] = tensor


def _empty_shared(cfg: ModelConfig, name: str) -> bool:
    """A shared expert of width 0: transformers saves its zero-size matrices and its gate, which
    multiplies nothing."""
    return cfg.moe and not cfg.shared_expert_intermediate_size and ".mlp.shared_expert" in name


def generation_settings(path: str | Path, cfg: ModelConfig) -> tuple[tuple[int, ...], Sampling]:
    """From ``generation_config.json`` (absent: the config's eos ids, greedy): the stop ids (the
    config's eos ids and the file's: a chat release ends its turns with a token, Qwen3.5's
    <|im_end|>, that config.json does not name; without it, generation runs on past the answer
    and makes up the next turns) and the release's sampling defaults (greedy unless it says
    ``do_sample``; transformers' defaults for what it leaves out: temperature 1, top_k 50,
    top_p 1). Kept out of the config: they change no state, so they must not change the model
    fingerprint (and with it every capsule's)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return cfg.eos_token_ids, GREEDY
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{file}: unreadable ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file}: not a JSON object")
    eos = raw.get("eos_token_id")
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size for i in ids):
        raise CheckpointError(f"{file}: eos_token_id must be a token id below vocab_size={cfg.vocab_size} or a "
                              f"list of them, got {eos!r}")
    stops = tuple(dict.fromkeys(cfg.eos_token_ids + tuple(ids)))
    if raw.get("do_sample") is not True:
        return stops, GREEDY
    try:
        how = inputs.sampling(raw.get("temperature", 1.0), raw.get("top_k", 50), raw.get("top_p", 1.0))
    except InvalidArgument as exc:
        raise CheckpointError(f"{file}: {exc}") from None
    if not how.sampled:
        raise CheckpointError(f"{file}: do_sample with temperature 0; a greedy release says do_sample false")
    return stops, how


def save_checkpoint(path: str | Path, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the layout ``load_checkpoint`` reads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2) + "\n")
    save_file({n: t.contiguous() for n, t in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def fingerprint(cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> str:
    """BLAKE3 of the config, the compute dtype (if given), and every weight's name, dtype,
    shape and bytes (the hash a multi-GB checkpoint is read through at every start)."""
    h = blake3(max_threads=blake3.AUTO)   # every core: it reads the whole checkpoint
    h.update(cfg.fingerprint().encode())
    if dtype is not None:
        h.update(f"|compute {dtype}|".encode())
    for name in sorted(weights):
        t = weights[name].detach().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).cpu().numpy() if t.numel() else b"")
    return h.hexdigest(length=16)
