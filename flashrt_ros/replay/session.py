"""What a replay needs to rebuild the engine a session ran on."""
from __future__ import annotations

import tempfile
from typing import Any

import torch

from ..capsule import TIERS
from ..errors import InvalidArgument
from ..runtime import Engine

VERSION = 1


def session_of(engine: Engine, model_path: str, seed: int) -> dict[str, Any]:
    store = engine.capsules
    return {"version": VERSION, "model_path": str(model_path or ""), "seed": seed,
            "dtype": str(engine.dtype).removeprefix("torch."), "max_seq_len": engine.max_seq_len,
            "obs_dim": engine.config.obs_dim, "action_dim": engine.config.action_dim,
            "rollback_depth": engine.rollback_depth,
            "budgets": {t: store.budget_bytes(t) for t in TIERS}, "spill": store.spill,
            "disk_tier": store.dir is not None, "model_fingerprint": engine.model_fingerprint,
            "layout_fingerprint": engine.layout_fingerprint,
            # Replay is byte-exact on the same kernels: another torch (or another
            # flashrt_ros attention path) may round differently.
            "torch": torch.__version__,
            # And at the same thread count: torch splits a large elementwise op (SiLU,
            # softplus) over its threads, and the last few elements of each share take
            # a scalar path that can round differently (prefill only; decode rows are small).
            "torch_threads": torch.get_num_threads()}


def engine_for(session: dict[str, Any], device: str = "cpu") -> Engine:
    """A fresh engine like the recorded one; refuses if its fingerprints come out different."""
    if session.get("version") != VERSION:
        raise InvalidArgument(f"session format version {session.get('version')!r}, this replay reads {VERSION}")
    capsule_dir = tempfile.mkdtemp(prefix="flashrt-replay-") if session["disk_tier"] else None
    engine = Engine.load(session["model_path"], seed=session["seed"],
                         policy_dims=(session["obs_dim"], session["action_dim"]), device=device,
                         dtype=getattr(torch, session["dtype"]), max_seq_len=session["max_seq_len"],
                         rollback_depth=session["rollback_depth"], budgets=session["budgets"] or None,
                         spill=session["spill"], capsule_dir=capsule_dir)
    for key in ("model_fingerprint", "layout_fingerprint"):
        if getattr(engine, key) != session[key]:
            raise InvalidArgument(f"the rebuilt engine's {key} differs from the recorded one: "
                                  f"different weights or layout ({session['model_path'] or 'embedded default'})")
    return engine
