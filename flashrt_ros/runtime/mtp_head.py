"""MTP head files: a checkpoint's ``mtp.*`` tensors on their own, as ``flashrt-train-mtp`` writes
them, for checkpoints that ship none (transformers drops ``mtp.*`` when it saves a model).

A head file is a safetensors file with every ``mtp.*`` tensor the config implies, under the
checkpoint's names (so that it also serves as one more shard of a checkpoint folder without a
shard index), and optionally ``mtp.draft_vocab``: int64 token ids, the only ones the
head drafts (its logits are then a product with those lm_head columns alone, a fraction of the
bytes). Its metadata says which model it was distilled from (``distilled_from``, that model's
fingerprint without ``mtp.*``) and how often its drafts were accepted.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError
from .config import ModelConfig
from .weights import DRAFT_VOCAB, expected_shapes, fingerprint

__all__ = ["DRAFT_VOCAB", "base_fingerprint", "check_draft_vocab", "head_names", "load", "save", "with_head"]

log = logging.getLogger(__name__)


def head_names(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The ``mtp.*`` tensors ``cfg`` implies and their shapes."""
    return {name: shape for name, shape in expected_shapes(cfg).items() if name.startswith("mtp.")}


def base_fingerprint(cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> str:
    """The fingerprint of the weights a head drafts for: every tensor but ``mtp.*``."""
    return fingerprint(cfg, {n: t for n, t in weights.items() if not n.startswith("mtp.")})


def check_draft_vocab(cfg: ModelConfig, vocab: torch.Tensor) -> torch.Tensor:
    """``vocab`` as an int64 [V'] of distinct token ids, or CheckpointError."""
    if not isinstance(vocab, torch.Tensor) or vocab.dtype != torch.int64 or vocab.dim() != 1 or not vocab.numel():
        raise CheckpointError(f"{DRAFT_VOCAB} must be a non-empty 1-D int64 tensor of token ids")
    if int(vocab.min()) < 0 or int(vocab.max()) >= cfg.vocab_size or vocab.unique().numel() != vocab.numel():
        raise CheckpointError(f"{DRAFT_VOCAB} must hold distinct token ids in [0, {cfg.vocab_size})")
    return vocab


def load(path: str | Path, cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The head's tensors (the ``mtp.*`` weights, and ``mtp.draft_vocab`` when it has one) and
    its metadata; CheckpointError if the file is not a head for ``cfg``."""
    if not cfg.mtp_num_hidden_layers:
        raise CheckpointError(f"{path}: this model has no MTP layer (mtp_num_hidden_layers=0) to take a head")
    shapes = head_names(cfg)
    try:
        with safe_open(str(path), framework="pt") as reader:
            meta = dict(reader.metadata() or {})
            names = set(reader.keys())
            missing = sorted(set(shapes) - names)
            if missing:
                raise CheckpointError(f"{path}: not an MTP head for this model: no {', '.join(missing[:3])}")
            head = {}
            for name in sorted(names & (set(shapes) | {DRAFT_VOCAB})):
                tensor = reader.get_tensor(name)
                if name != DRAFT_VOCAB and tuple(tensor.shape) != shapes[name]:
                    raise CheckpointError(f"{path}: {name} has shape {tuple(tensor.shape)}, the config implies "
                                          f"{shapes[name]}")
                head[name] = tensor
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"cannot read MTP head {path}: {exc}") from None
    if DRAFT_VOCAB in head:
        check_draft_vocab(cfg, head[DRAFT_VOCAB])
    return head, meta


def save(path: str | Path, head: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a head file (tensors made contiguous and owned, as safetensors wants)."""
    save_file({n: t.detach().contiguous().clone() for n, t in head.items()}, str(path), metadata=metadata)


def with_head(cfg: ModelConfig, weights: dict[str, torch.Tensor], seeded: Sequence[str],
              path: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``weights`` with the head file at ``path`` in place of their ``mtp.*``, and the names of
    ``seeded`` that are still seeded."""
    head, meta = load(path, cfg)
    base = meta.get("distilled_from")
    if base and base != base_fingerprint(cfg, weights):
        log.warning("MTP head %s was distilled from another model (%s): its drafts will rarely be accepted",
                    path, base)
    return weights | head, [name for name in seeded if not name.startswith("mtp.")]
