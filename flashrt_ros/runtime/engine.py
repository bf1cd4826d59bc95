"""The engine: one model, one state arena, committed boundaries under one lock.

Start-up runs in a fixed, visible order: build -> load weights -> allocate the
arena -> warm up -> capture graphs. After that, every public call that changes
state takes the lock, advances by whole boundaries and leaves the arena
consistent, so a snapshot can slot in between any two of them.
"""
from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..errors import InvalidArgument
from . import weights as weights_io
from .arena import StateArena
from .config import ModelConfig
from .graph import Step
from .models.qwen35 import Qwen35, state_specs

log = logging.getLogger(__name__)

# float64 is there to check the arithmetic itself against a float64 reference.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_OPTIONS = {"cuda_graphs": True, "static_shapes": False, "prefill_chunk": 512, "flush_denormal": True,
            "decode_threads": 1}


class Engine:
    """Serve a Qwen3.5-style hybrid model whose whole execution state lives in one arena.

    Options (keyword arguments of both constructors):
      cuda_graphs: capture decode as CUDA graphs when the device is CUDA (default True).
      static_shapes: run decode with the fixed shapes a graph needs even when eager
        (what the graph computes, checkable on a CPU).
      prefill_chunk: prompt tokens per prefill pass; bounds attention memory.
      flush_denormal: on a CPU, set flush-to-zero on the thread that runs each step
        (default True). Decaying recurrent states reach denormal floats, which make
        x86 arithmetic several times slower; the flag persists on that thread.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_seq_len: int = 4096, seeded: Sequence[str] = (),
                 **options: Any) -> None:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise InvalidArgument(f"unknown engine options {unknown}; known: {sorted(_OPTIONS)}")
        opts = {**_OPTIONS, **options}
        if not isinstance(max_seq_len, int) or max_seq_len < 1:
            raise InvalidArgument(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if dtype not in _DTYPES:
            raise InvalidArgument(f"dtype {dtype} is not supported ({', '.join(map(str, _DTYPES))})")
        if int(opts["prefill_chunk"]) < 1:
            raise InvalidArgument(f"prefill_chunk must be >= 1, got {opts['prefill_chunk']}")
        self.config = cfg
        self.device = torch.device(device)
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.seeded_weights = tuple(seeded)
        self._prefill_chunk = int(opts["prefill_chunk"])
        self._flush_denormal = bool(opts["flush_denormal"]) and self.device.type == "cpu"
        self._decode_threads = int(opts["decode_threads"]) if self.device.type == "cpu" else 0
        self._lock = threading.RLock()

        # 1. build + 2. load weights (fused into the model's own layout)
        self.model = Qwen35(cfg, weights, self.device, dtype, max_seq_len)
        self.model_fingerprint = weights_io.fingerprint(cfg, {n: t.to(dtype) if t.is_floating_point() else t
                                                              for n, t in weights.items()})
        # 3. allocate the arena (one allocation) and hand the model its views
        self.arena = StateArena(state_specs(cfg, max_seq_len, dtype), self.device)
        self.model.bind(self.arena)
        self.layout_fingerprint = self.arena.layout_fingerprint()
        self._position = 0
        # 4. warm up + 5. capture graphs (the warm-up writes state, so zero it after)
        self.cuda_graphs = bool(opts["cuda_graphs"]) and self.device.type == "cuda"
        self._fixed_shapes = self.cuda_graphs or bool(opts["static_shapes"])
        self._obs_in = self._action_out = None
        with torch.inference_mode():
            self._token_step = Step(
                lambda: self.model.token_step(self.model.decode_span(self._position, self._fixed_shapes)),
                capture=self.cuda_graphs)
            self._policy_step = None
            if cfg.policy:
                self._obs_in = torch.zeros(cfg.obs_dim, device=self.device)
                self._action_out = torch.zeros(cfg.action_dim, device=self.device)
                self._policy_step = Step(
                    lambda: self.model.policy_step(self._obs_in, self._action_out,
                                                   self.model.decode_span(self._position, self._fixed_shapes)),
                    capture=self.cuda_graphs)
            self.arena.buffer.zero_()
        if self.cuda_graphs:
            torch.cuda.synchronize(self.device)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, max_seq_len: int = 4096, **options: Any) -> "Engine":
        """An engine with deterministic seeded weights (the embedded default uses ``ModelConfig.tiny()``)."""
        return cls(cfg, weights_io.seeded_weights(cfg, seed), device=device, dtype=dtype,
                   max_seq_len=max_seq_len, seeded=tuple(weights_io.expected_shapes(cfg)), **options)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, max_seq_len: int = 4096, seed: int = 0,
                        **options: Any) -> "Engine":
        """Load a Hugging Face checkpoint folder (config.json + *.safetensors, single or sharded).

        ``mtp.*`` and policy weights absent from the checkpoint are seeded with ``seed``.
        """
        cfg, weights, seeded = weights_io.load_checkpoint(path, seed)
        return cls(cfg, weights, device=device, dtype=dtype, max_seq_len=max_seq_len, seeded=seeded, **options)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Committed positions (tokens and observation steps) in the state."""
        return self._position

    @property
    def region_table(self) -> tuple[dict, ...]:
        return self.arena.region_table

    @property
    def lock(self) -> threading.RLock:
        """Held for every committed boundary; hold it to read a consistent state."""
        return self._lock

    def state_digest(self) -> str:
        """blake2b over every region's live bytes (per-token regions only up to position)."""
        with self._lock:
            return self.arena.digest(self._position)

    def reset(self) -> None:
        """Back to the empty state (position 0), as after construction."""
        with self._lock:
            self.arena.buffer.zero_()
            self._position = 0

    # ---- work ----------------------------------------------------------------------------------
    @contextmanager
    def _work(self, step: bool = False) -> Iterator[None]:
        """The lock plus inference mode; flush-to-zero on this thread and, for one-row
        steps, the decode thread count, when asked for."""
        with self._lock, torch.inference_mode():
            if self._flush_denormal:
                torch.set_flush_denormal(True)
            threads = torch.get_num_threads()
            if step and self._decode_threads:
                torch.set_num_threads(self._decode_threads)
            try:
                yield
            finally:
                torch.set_num_threads(threads)

    def prefill(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` to the state, commit a boundary, return next-token logits [vocab]."""
        ids = self._check_tokens(token_ids)
        with self._work():
            self._check_room(ids.numel())
            ids = ids.to(self.device)
            for start in range(0, ids.numel(), self._prefill_chunk):
                chunk = ids[start:start + self._prefill_chunk]
                self.model.prefill(chunk, self._position)
                self._position += chunk.numel()
            return self.model.logits()[0].float()

    def logits(self) -> torch.Tensor:
        """Next-token logits [vocab] of the current state (fp32)."""
        with self._work():
            return self.model.logits()[0].float()

    def generate(self, n: int) -> list[int]:
        """Greedy: append ``n`` tokens, one committed boundary each; return them."""
        return list(self.stream(n, sync_every=0))

    def stream(self, n: int, sync_every: int = 1) -> Iterator[int]:
        """Greedy, yielding tokens as they are committed.

        The lock is taken per token, so other callers (a snapshot) wait at most
        one decode step. ``sync_every``: read tokens back every k steps (one
        device sync each); 0 reads them all at the end.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"number of tokens must be an int >= 0, got {n!r}")
        with self._lock:
            self._check_room(n)
        # Each step copies its token into a device-side list under the lock, so the
        # result is right even if another caller restores state between two steps,
        # and reading it back costs one sync per ``sync_every`` tokens, not per token.
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        read = 0
        for i in range(n):
            with self._work(step=True):
                self._check_room(1)
                self._token_step()
                self._position += 1
                out[i] = self.model.tokens[self._position - 1]
            if sync_every and (i + 1) % sync_every == 0:
                yield from out[read:i + 1].tolist()
                read = i + 1
        if read < n:
            yield from out[read:n].tolist()

    def step(self, observation: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Policy mode: one observation vector in, one action vector out; commits a boundary."""
        cfg = self.config
        if not cfg.policy:
            raise InvalidArgument("this model has no policy heads (obs_dim = action_dim = 0)")
        try:
            obs = torch.as_tensor(observation, dtype=torch.float32).flatten()
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"observation is not a vector of numbers: {exc}") from None
        if obs.numel() != cfg.obs_dim:
            raise InvalidArgument(f"observation has {obs.numel()} values, the model expects obs_dim={cfg.obs_dim}")
        if not torch.isfinite(obs).all():
            raise InvalidArgument("observation contains NaN or infinity")
        with self._work(step=True):
            self._check_room(1)
            self._obs_in.copy_(obs)
            self._policy_step()
            self._position += 1
            return self._action_out.cpu().clone()

    # ---- checks --------------------------------------------------------------------------------
    def _check_tokens(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        try:
            ids = torch.as_tensor(token_ids)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise InvalidArgument(f"token ids must be a sequence of ints: {exc}") from None
        if ids.numel() == 0:
            raise InvalidArgument("token ids are empty")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dtype.is_complex:
            raise InvalidArgument(f"token ids must be integers, got dtype {ids.dtype}")
        ids = ids.flatten().to(torch.int64)
        bad = (ids < 0) | (ids >= self.config.vocab_size)
        if bad.any():
            first = int(ids[bad][0])
            raise InvalidArgument(
                f"token id {first} is out of range [0, {self.config.vocab_size}) ({int(bad.sum())} bad ids)")
        return ids

    def _check_room(self, n: int) -> None:
        if self._position + n > self.max_seq_len:
            raise InvalidArgument(
                f"{n} more positions would exceed max_seq_len={self.max_seq_len} "
                f"(position is {self._position})")

