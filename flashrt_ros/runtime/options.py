"""The engine's options: one frozen value, checked when it is made."""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..capsule import signing
from ..errors import InvalidArgument
from .inputs import is_int


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """Keyword arguments of ``Engine`` and its constructors, beyond the model, device and dtype.

    cuda_graphs: capture decode as CUDA graphs when the device is CUDA.
    static_shapes: run decode with the fixed shapes a graph needs even when eager (what the
      graph computes, checkable on a CPU).
    prefill_chunk: prompt tokens per prefill pass; bounds attention memory.
    flush_denormal: on a CPU, set flush-to-zero on the thread that runs each step. Decaying
      recurrent states reach denormal floats, which make x86 arithmetic several times slower;
      the flag persists on that thread.
    decode_threads: on a CPU, the torch thread count for one-row steps (decode and policy
      steps); 0 keeps torch's own.
    cpu_kernels: on a CPU in float32, run the CPU backend where the package's C library is built
      (``runtime.backends.cpu``): products of up to a few rows (decode and policy steps) on its
      row kernel, and every linear-attention mixer on its delta kernel. They round otherwise
      than torch's, so a rollback or a replay runs with the engine's own setting, and
      ``engine.cpu_kernels`` says which runs.
    capsule_dir: the disk tier's folder (None: no disk tier).
    budgets: bytes per tier; tiers left out take the engine's defaults.
    spill: over budget, move the least recently used unpinned capsule down a tier (False: refuse).
    rollback_depth: committed boundaries ``rollback(steps)`` can go back through.
    max_draft_tokens: the most drafts a speculative pass verifies (``generate(speculative=k)``,
      k up to this); the engine keeps the fixed-size state of that many rows plus one.
    capsule_key: bytes that sign every capsule file written (HMAC-SHA256); files without a valid
      signature are then refused, at start and on restore (``capsule.signing``). None: files
      carry digests, which catch accidents, not deliberate edits.
    """

    cuda_graphs: bool = True
    static_shapes: bool = False
    prefill_chunk: int = 512
    flush_denormal: bool = True
    decode_threads: int = 0
    cpu_kernels: bool = True
    capsule_dir: str | Path | None = None
    budgets: dict | None = None
    spill: bool = True
    rollback_depth: int = 8
    max_draft_tokens: int = 4
    capsule_key: bytes | None = None

    def tier_budgets(self, arena_bytes: int) -> dict[str, int]:
        """``budgets`` over the defaults: 8 arenas' bytes on the device, 32 on the host, 4 GiB on disk."""
        return {"device": 8 * arena_bytes, "host": 32 * arena_bytes, "disk": 4 << 30} | (self.budgets or {})

    @classmethod
    def of(cls, options: dict[str, Any]) -> "EngineOptions":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidArgument(f"unknown engine options {unknown}; known: {sorted(known)}")
        return cls(**options)

    def __post_init__(self) -> None:
        for key, least in (("prefill_chunk", 1), ("decode_threads", 0), ("rollback_depth", 1),
                           ("max_draft_tokens", 1)):
            value = getattr(self, key)
            if not is_int(value) or value < least:
                raise InvalidArgument(f"{key} must be an int >= {least}, got {value!r}")
        for key in ("cuda_graphs", "static_shapes", "flush_denormal", "spill", "cpu_kernels"):
            if not isinstance(getattr(self, key), bool):   # bool("false") is True
                raise InvalidArgument(f"{key} must be True or False, got {getattr(self, key)!r}")
        if self.budgets is not None and not isinstance(self.budgets, dict):
            raise InvalidArgument(f"budgets must be a dict of bytes per tier, got {self.budgets!r:.60}")
        folder = self.capsule_dir
        text = os.fspath(folder) if isinstance(folder, (str, os.PathLike)) else None
        if folder is not None and (not isinstance(text, str) or not text or "\0" in text):
            # "" would read as the working directory to a Path and as no disk tier to the store.
            raise InvalidArgument(f"capsule_dir must be a non-empty path without NUL bytes (None: no disk tier), "
                                  f"got {folder!r:.60}")
        key = self.capsule_key
        if key is not None and (not isinstance(key, bytes)
                                or not signing.MIN_KEY_BYTES <= len(key) <= signing.MAX_KEY_BYTES):
            raise InvalidArgument(f"capsule_key must be None or {signing.MIN_KEY_BYTES} to {signing.MAX_KEY_BYTES} "
                                  f"bytes (signing.load_key reads a key file), got {type(key).__name__}")
