"""The engine: one model, one state arena, committed boundaries under one lock.

Start-up runs in a fixed, visible order: build -> load weights -> allocate the arena -> warm
up -> capture graphs. After that, each public call checks its arguments, takes the lock, has
the capsule store plan any copy to or from a capsule, and leaves the move to ``LiveState``,
which assigns the next boundary once (``streaming`` commits a stream one turn of the lock at
a time). The arena is consistent between any two calls, so a snapshot can slot in there.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..capsule import CapsuleInfo, CapsuleStore, Layout
from ..errors import InvalidArgument, NotActive
from . import inputs, loading, streaming, weights as weights_io
from .arena import StateArena
from .backends import cpu as cpu_backend
from .config import ModelConfig
from .decoding import Decoder
from .fairlock import FairRLock
from .history import DECODE, PREFILL, STEP
from .live_state import LiveState
from .models.qwen35 import Qwen35, state_specs
from .options import EngineOptions
from .sampling import GREEDY, Sampling
from .speculative import Speculation, SpeculationStats


class Engine:
    """Serve a Qwen3.5-style hybrid model whose whole execution state lives in one arena.

    Options are keyword arguments of both constructors: see ``EngineOptions``.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_seq_len: int = 4096, seeded: Sequence[str] = (),
                 **options: Any) -> None:
        opts = EngineOptions.of(options)
        self.max_seq_len = inputs.max_seq_len(max_seq_len)
        self.dtype = inputs.dtype(dtype)
        weights, draft_vocab = loading.model_weights(cfg, weights)
        self.config = cfg
        self.device = inputs.device(device)
        self.seeded_weights = tuple(seeded)
        # Where generation stops (the tokenizer may add its own eos), and how the release
        # samples (``generate(**engine.sampling_defaults.as_kwargs())``; greedy stays the
        # default of generate and stream): from_pretrained reads generation_config.json's.
        self.stop_token_ids: tuple[int, ...] = cfg.eos_token_ids
        self.sampling_defaults: Sampling = GREEDY
        self._flush_denormal = opts.flush_denormal and self.device.type == "cpu"
        self._decode_threads = opts.decode_threads if self.device.type == "cpu" else 0
        self._lock = FairRLock()
        self._closed = False
        # Everything built here is a normal tensor even when the caller is inside
        # torch.inference_mode(): the capsule calls and the digest thread write into the
        # arena, the pool and the rollback ring outside it, which inference tensors refuse.
        with torch.inference_mode(False):
            try:
                self._build(cfg, weights, opts, draft_vocab)
            except BaseException as exc:
                if hasattr(self, "capsules"):   # its digest thread and device pool: a refusal keeps nothing
                    self.capsules.close()
                if hasattr(self, "decoder"):    # nor its weights, held by the steps' closures (Decoder.close)
                    self.decoder.close()
                # The allocator's own error: the weights or the state do not fit.
                if not isinstance(exc, torch.OutOfMemoryError) and not (
                        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)):
                    raise
                raise InvalidArgument(f"the engine does not fit in {self.device}'s memory (max_seq_len="
                                      f"{self.max_seq_len}, rollback_depth={opts.rollback_depth}): "
                                      f"{str(exc).splitlines()[0][:200]}") from None

    def _build(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], opts: EngineOptions,
               draft_vocab: torch.Tensor | None) -> None:
        # 1. build + 2. load weights (fused into the model's own layout)
        self.cpu_kernels = cpu_backend.chosen(opts.cpu_kernels, self.device, self.dtype)
        self.cuda_graphs = opts.cuda_graphs and self.device.type == "cuda"
        # Decode over every cache row with a mask (what a graph needs) rather than the live rows,
        # and route experts with fixed shapes: the same tokens, other roundings, so a replay must
        # know which.
        self.fixed_shapes = self.cuda_graphs or opts.static_shapes
        self.model = Qwen35(cfg, weights, self.device, self.dtype, self.max_seq_len, cpu_kernels=self.cpu_kernels,
                            fixed_shapes=self.fixed_shapes)
        # The weights as given plus the dtype the engine computes in: the model keeps norms,
        # A_log and dt_bias in fp32 whatever that dtype, so weights equal only once cast to it
        # are not the same model (hashing the cast weights once let such a model's capsule in).
        self.model_fingerprint = weights_io.fingerprint(cfg, weights, self.dtype)
        # 3. allocate the arena (one allocation) and hand the model its views
        max_draft = opts.max_draft_tokens if cfg.mtp_num_hidden_layers else 0
        if self.cpu_kernels and max_draft + 1 > cpu_backend.row_product.MAX_ROWS:
            raise InvalidArgument(f"max_draft_tokens={max_draft}: a verify of that many drafts and the main "
                                  f"model's token exceeds the row kernel's {cpu_backend.row_product.MAX_ROWS} rows")
        self.arena = StateArena(state_specs(cfg, self.max_seq_len, self.dtype), self.device)
        self.model.bind(self.arena, verify_rows=max_draft + 1 if max_draft else 0)
        self.layout_fingerprint = self.arena.layout_fingerprint()
        self.capsules = CapsuleStore(
            Layout(self.arena.regions, self.arena.fixed_bytes, self.layout_fingerprint, self.arena.region_table),
            self.model_fingerprint, self.device, opts.tier_budgets(self.arena.nbytes), opts.spill, opts.capsule_dir,
            lock=self._lock, log_kinds=(PREFILL, DECODE, STEP) if cfg.policy else (PREFILL, DECODE),
            key=opts.capsule_key)
        # 4. warm up + 5. capture graphs (the decoder zeroes the state its warm-ups wrote)
        with torch.inference_mode():
            self.decoder = Decoder(self.model, self.arena, max_seq_len=self.max_seq_len,
                                   prefill_chunk=opts.prefill_chunk, fixed_shapes=self.fixed_shapes,
                                   cuda_graphs=self.cuda_graphs, max_draft=max_draft, draft_vocab=draft_vocab)
        self._live = LiveState(self.arena, self.decoder, self.capsules, opts.rollback_depth, self.max_seq_len)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, max_seq_len: int = 4096,
                    mtp_head: str | Path | None = None, **options: Any) -> "Engine":
        """An engine with deterministic seeded weights (the embedded default uses ``ModelConfig.tiny()``).
        ``mtp_head``: a head file (``runtime.mtp_head``) in place of the seeded MTP layer."""
        loaded = loading.seeded(cfg, seed, mtp_head)
        return cls(cfg, loaded.weights, device=device, dtype=dtype, max_seq_len=max_seq_len, seeded=loaded.seeded,
                   **options)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu",
                        dtype: torch.dtype = torch.float32, max_seq_len: int = 4096, seed: int = 0,
                        policy_dims: tuple[int, int] | None = None, mtp_head: str | Path | None = None,
                        **options: Any) -> "Engine":
        """Load a Hugging Face checkpoint folder (config.json + *.safetensors, single or sharded).

        ``mtp.*`` and policy weights absent from the checkpoint are seeded with ``seed``.
        ``policy_dims`` = (obs_dim, action_dim) overrides the checkpoint's policy heads.
        ``mtp_head``: a head file (``runtime.mtp_head``, as ``flashrt-train-mtp`` writes) in
        place of the checkpoint's MTP layer.
        """
        loaded = loading.pretrained(path, seed, policy_dims, mtp_head)
        engine = cls(loaded.cfg, loaded.weights, device=device, dtype=dtype, max_seq_len=max_seq_len,
                     seeded=loaded.seeded, **options)
        engine.stop_token_ids, engine.sampling_defaults = loaded.stop_token_ids, loaded.sampling
        return engine

    @classmethod
    def load(cls, model_path: str | Path | None = None, *, seed: int = 0,
             policy_dims: tuple[int, int] | None = None, **kwargs: Any) -> "Engine":
        """The checkpoint at ``model_path``, or the embedded default (``ModelConfig.tiny()``) when empty."""
        if model_path:
            return cls.from_pretrained(model_path, seed=seed, policy_dims=policy_dims, **kwargs)
        obs, act = policy_dims or (0, 0)
        return cls.from_config(ModelConfig.tiny(obs_dim=obs, action_dim=act), seed=seed, **kwargs)

    # ---- state ---------------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Committed positions (tokens and observation steps) in the state."""
        return self._live.state.position

    @property
    def lineage(self) -> int:
        """Changes whenever the live state is replaced rather than extended: a restore, a
        rollback that moves back, a reset. A caller committing tokens across several calls
        (a generate goal) checks it under ``lock`` to know that it still extends its own state."""
        return self._live.state.lineage

    @property
    def rollback_origin(self) -> str:
        """The id of the capsule the last ``rollback(to_position=...)`` started its replay from
        ("" when it started from the ring or from the empty state)."""
        return self._live.state.origin

    @property
    def sampling_seed(self) -> int:
        """The RNG state of sampled decoding: its seed (0 after a reset; the position is the counter)."""
        with self._lock:
            return int(self.model.rng_seed[0])

    @property
    def rollback_depth(self) -> int:
        return self._live.slots.depth

    @property
    def region_table(self) -> tuple[dict, ...]:
        return self.arena.region_table

    @property
    def lock(self) -> FairRLock:
        """Held for every committed boundary; hold it to read a consistent state."""
        return self._lock

    def state_digest(self) -> str:
        """The live state's digest (``flashrt_ros.digest``): the one its capsule would carry."""
        with self._lock:
            return self._live.digest()

    def close(self) -> None:
        """Release the capsule store's memory and its digest thread (disk capsules stay on
        disk), and the decoder's steps, so that the weights go with the engine's last reference.
        The engine must not be used afterwards."""
        self.capsules.close()
        with self._lock:   # an operation in flight finishes first; a later one is refused
            self._closed = True
            self.decoder.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        # A process that exits with the digest thread mid-hash inside torch can abort.
        self.close()

    def reset(self) -> None:
        """Back to the empty state (position 0), as after construction. Capsules stay."""
        with self._lock:
            self._live.reset()

    # ---- work ----------------------------------------------------------------------------------
    @contextmanager
    def _work(self, step: bool = False) -> Iterator[None]:
        """The lock plus inference mode; flush-to-zero on this thread and, for one-row
        steps, the decode thread count, when asked for. Digests that snapshots queued
        start now, alongside this step, not inside the snapshot call (see capsule.digest_worker)."""
        self.capsules.start_digests()
        with self._lock, torch.inference_mode():
            if self._closed:
                raise NotActive("this engine is closed")
            if self._flush_denormal:
                torch.set_flush_denormal(True)
            if not (step and self._decode_threads):
                yield
                return
            threads = torch.get_num_threads()
            torch.set_num_threads(self._decode_threads)
            try:
                yield
            finally:
                torch.set_num_threads(threads)

    def prefill(self, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Append ``token_ids`` to the state, commit a boundary, return next-token logits [vocab]."""
        ids = inputs.token_ids(token_ids, self.config.vocab_size)
        with self._work():
            self._live.check_room(ids.numel())
            self._live.prefill(ids.to(self.device))
            return _caller_owned(self.model.logits()[0].float())

    def logits(self) -> torch.Tensor:
        """Next-token logits [vocab] of the current state (fp32)."""
        with self._work():
            return _caller_owned(self.model.logits()[0].float())

    def generate(self, n: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int | None = None, speculative: int | None = None) -> list[int]:
        """Append ``n`` tokens, one committed boundary each; return them. Greedy by default;
        see ``stream`` for ``temperature``, ``top_k``, ``top_p``, ``seed`` and ``speculative``."""
        return list(self.stream(n, sync_every=0, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                                speculative=speculative))

    def stream(self, n: int, sync_every: int = 1, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int | None = None, scored: bool = False,
               speculative: int | None = None) -> Iterator[int] | Iterator[tuple[int, float, int]]:
        """Yield tokens as they are committed: greedy, or drawn from softmax(logits / temperature)
        over the ``top_k`` most likely (0: all) within the nucleus of mass ``top_p`` (1: all),
        as transformers' warpers cut (``sampling``). ``scored``: yield (token, margin, position)
        triples, the margin being the gap between the two best scores of the choice in logit
        units (``sampling.margin``), which a replay on another platform needs to tell a near-tie
        from a real difference, and the position the token's boundary left (several tokens of
        one pass are committed together).

        The lock is taken per token (per pass when speculative), so other callers (a
        snapshot) wait at most one decode step or pass. ``sync_every``: read tokens back
        every k tokens (one device sync each); 0 reads them all at the end. The draws come
        from the RNG state in the arena (``sampling_seed``, with the position as counter),
        so a restored capsule draws the same tokens again; ``seed`` sets that state first
        (it then belongs to the state, as the tokens do).

        ``speculative`` = k >= 1: each pass drafts up to k tokens with the MTP layer and
        verifies them in one forward of the main model (``runtime.speculative``): the same
        tokens and, on the CPU backend, the same state bytes at every committed boundary as
        plain decode, each token its own boundary (rollback steps count tokens). Near
        ``max_seq_len`` or the end of ``n`` a pass drafts fewer. Passes whose drafts are
        rarely accepted turn speculation off for a while (``speculation_stats``).
        """
        # Checked here, not in the generator: a bad call must fail when made, before any
        # token is committed, not at the first next().
        request = streaming.Request(inputs.count(n, "number of tokens"), inputs.count(sync_every, "sync_every"),
                                    inputs.sampling(temperature, top_k, top_p), inputs.optional_seed(seed),
                                    bool(scored), self.check_speculative(speculative))
        with self._lock:
            self._live.check_room(request.n)
            lineage = self._live.state.lineage
        return streaming.stream(self._live, partial(self._work, step=True), request, lineage)

    def check_speculative(self, speculative: int | None) -> int:
        """The drafts per pass ``speculative`` asks for (0: none), or InvalidArgument: what
        ``stream`` checks first, for a caller to check before it commits anything else."""
        return self.decoder.drafts_for(speculative)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """Speculative decoding's counts so far (None without an MTP layer); a copy."""
        with self._lock:
            return None if self.speculation is None else replace(self.speculation.stats)

    @property
    def speculation(self) -> Speculation | None:
        """Speculative decoding's drafter and switch-off rule (None without an MTP layer)."""
        return self.decoder.speculation

    def append(self, token: int, *, seed: int | None = None) -> None:
        """Commit ``token`` as the next decode boundary, as if decode had chosen it (the same
        bytes as that decode): a replay on another platform continues from the recorded token
        where its own choice, at a near-tie, came out different. ``seed`` sets the sampling
        RNG state first, as ``stream`` does."""
        token = inputs.token(token, self.config.vocab_size)
        seed = inputs.optional_seed(seed)
        with self._work(step=True):
            self._live.check_room(1)
            if seed is not None:
                self.model.rng_seed.fill_(int(seed))
            self._live.logged_token(token)

    def step(self, observation: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Policy mode: one observation vector in, one action vector out; commits a boundary."""
        cfg = self.config
        if not cfg.policy:
            raise InvalidArgument("this model has no policy heads (obs_dim = action_dim = 0)")
        obs = inputs.observation(observation, cfg.obs_dim)
        with self._work(step=True):
            self._live.check_room(1)
            # Finite inputs near the float32 limit (a common "unknown" sentinel) can overflow
            # inside the model; committed, every later action would be NaN.
            return _caller_owned(self._live.step(obs, finite_only=True).cpu())

    # ---- capsules --------------------------------------------------------------------------------
    def snapshot(self, name: str | None = None, tier: str = "device", pin: bool = False) -> CapsuleInfo:
        """Capture the whole state at the current committed boundary as a new capsule.

        Per-token rows that the live state shares with the capsule it descends
        from (the last one restored or taken) are referenced, not copied. The
        digest is computed in the background; ``capsules.get(id)`` waits for it.
        """
        with self._lock:  # copies only: no inference mode or thread settings (the store shares this lock)
            state = self._live.state
            plan = self.capsules.plan_snapshot(state.position, name=name, tier=tier, pin=pin,
                                               parent=state.base.capsule if state.base else "",
                                               base=state.base, log_runs=state.log)
            return self._live.snapshot(plan)

    def fork(self, source: str | CapsuleInfo | None = None, name: str | None = None) -> CapsuleInfo:
        """A new capsule branching from ``source`` (a capsule), or from the live state.

        From a capsule it is metadata only: every byte is shared with the source,
        copy-on-write (capsules are immutable, so nothing is ever written). From
        the live state it is a snapshot whose parent is the capsule the state
        descends from. Its digest is computed in the background, as a snapshot's is,
        except that a fork of a capsule already hashed takes over its digest at once.
        """
        if source is None or source == "":
            return self.snapshot(name=name)
        with self._work():
            if isinstance(source, CapsuleInfo):  # possibly another engine's: refused as restore refuses it
                self.capsules.check_compatible(source)
            return self.capsules.fork(self.capsules.resolve(source), name).info

    def restore(self, capsule: str | CapsuleInfo, verify: bool = False,
                regions: Sequence[str] | None = None) -> CapsuleInfo:
        """Make the capsule's state the live state; a refused restore changes nothing.

        Returning to a capsule the live state descends from (a checkpoint taken or
        restored earlier, then built on) copies back the fixed-size state and only
        the per-token rows written since: the older rows are still the capsule's.
        The same holds for a capsule that shares those rows with it (a fork of it,
        or an earlier snapshot it extended).

        ``verify``: re-hash the capsule's bytes before and the live state after the
        copy; on a mismatch the previous live state is put back and CorruptCapsule
        is raised. ``regions`` (groups such as ["kv"]) restores only those groups and
        sets the position: it exists for ablations, to show what a KV-only restore
        loses on a hybrid model; the result is not a state any run produced.
        """
        with self._lock:  # copies only: no inference mode or thread settings to pay for
            if isinstance(capsule, CapsuleInfo):  # possibly another engine's: check before looking it up
                self.capsules.check_compatible(capsule)
            record = self.capsules.resolve(capsule)
            self.capsules.check_compatible(record)
            groups = inputs.groups(regions, verify)
            base = self._live.state.base
            # Descending from a capsule, the live state holds that capsule's per-token rows
            # [0:p] (KV is append-only); those this capsule shares with it are not copied.
            keep = 0
            if base is not None and groups is None:
                keep = self.capsules.shared_rows(record, base.capsule, min(base.rows, record.info.position))
            if verify:
                self.capsules.verify(record)
            plan = self.capsules.plan_restore(record, keep, groups)   # a refusal here has changed nothing
            self._live.restore(plan, record.info, verify, partial=groups is not None)
            return record.info

    def rollback(self, steps: int = 1, to_position: int | None = None) -> int:
        """Go back ``steps`` committed boundaries, or exactly to token position ``to_position``.

        Steps come from the ring (fixed-size regions only; KV is append-only, so
        only the position moves back there). ``to_position`` restores the newest
        kept boundary at or before it, then replays the logged inputs up to it.
        Returns the new position.
        """
        with self._work():
            state = self._live.state
            if to_position is not None:
                self._live.replay_to(inputs.rollback_target(to_position, state.position))
            else:
                self._live.back(inputs.rollback_steps(steps, max(0, len(state.ring) - 1), self.rollback_depth))
            return self._live.state.position


def _caller_owned(t: torch.Tensor) -> torch.Tensor:
    """A copy the caller owns, as a normal tensor: what runs under inference mode makes
    inference tensors, which refuse in-place changes (``logits.div_(t)``) outside it."""
    with torch.inference_mode(False):
        return t.clone()
