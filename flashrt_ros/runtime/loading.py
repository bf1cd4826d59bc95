"""Where an engine's weights come from: seeded for a config (the embedded default), or a Hugging
Face checkpoint folder, either with an MTP head file in place of the model's MTP layer; and the
checks a set of weights passes before anything is built from it."""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from . import inputs, mtp_head as mtp_head_io, weights as weights_io
from .config import ModelConfig
from .sampling import GREEDY, Sampling

Weights = dict[str, torch.Tensor]


class Loaded(NamedTuple):
    """Weights for an engine: the config, the tensors by name, the names of those made from the
    seed (absent from the source), the tokens generation stops at, and the release's sampling
    defaults."""

    cfg: ModelConfig
    weights: Weights
    seeded: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    sampling: Sampling = GREEDY


def seeded(cfg: ModelConfig, seed: int, mtp_head: str | Path | None = None) -> Loaded:
    """Deterministic weights for ``cfg`` from ``seed``; ``mtp_head``: a head file in place of
    the seeded MTP layer."""
    inputs.check_seed(seed)
    weights = weights_io.seeded_weights(cfg, seed)
    names = list(weights_io.expected_shapes(cfg))
    if mtp_head:
        weights, names = mtp_head_io.with_head(cfg, weights, names, mtp_head)
    return Loaded(cfg, weights, tuple(names), cfg.eos_token_ids)


def pretrained(path: str | Path, seed: int, policy_dims: tuple[int, int] | None = None,
               mtp_head: str | Path | None = None) -> Loaded:
    """The checkpoint folder at ``path`` (``weights.load_checkpoint``: what it lacks is seeded with
    ``seed``), its stop tokens and sampling defaults from generation_config.json; ``mtp_head``: a head file in
    place of the checkpoint's MTP layer."""
    inputs.check_seed(seed)
    cfg, weights, names = weights_io.load_checkpoint(path, seed, policy_dims)
    if mtp_head:
        weights, names = mtp_head_io.with_head(cfg, weights, names, mtp_head)
    return Loaded(cfg, weights, tuple(names), *weights_io.generation_settings(path, cfg))


def model_weights(cfg: ModelConfig, weights: Weights) -> tuple[Weights, torch.Tensor | None]:
    """``weights`` checked against ``cfg`` (a tensor that does not fit fails here, not halfway
    through a prefill), and the MTP head's draft vocabulary taken out of them (None: drafts
    range over the whole vocabulary)."""
    weights = dict(weights)
    draft_vocab = weights.pop(mtp_head_io.DRAFT_VOCAB, None)
    if draft_vocab is not None:
        mtp_head_io.check_draft_vocab(cfg, draft_vocab)
    weights_io.check_weights(cfg, weights)
    return weights, draft_vocab
