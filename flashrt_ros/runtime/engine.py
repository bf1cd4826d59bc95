"""The engine: one model, one state arena, committed boundaries under one lock.

Start-up runs in a fixed, visible order: build -> load weights -> allocate the
arena -> warm up -> capture graphs. After that, every public call that changes
state takes the lock, advances by whole boundaries and leaves the arena
consistent, so a snapshot can slot in between any two of them.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import digest
from ..capsule import CapsuleInfo, CapsuleStore, InvalidCapsuleRequest, Layout
from ..capsule.errors import CapsuleError, CorruptCapsule
from ..errors import ContextFull, FlashRTError, InvalidArgument, Preempted, shown
from . import inputs, mtp_head, sampling, weights as weights_io
from .arena import GROUPS, StateArena
from .backends import cpu as cpu_backend
from .config import ModelConfig
from .fairlock import FairRLock
from .graph import Step
from .history import DECODE, PREFILL, STEP, Boundary, RingSlots, appended, between as runs_between, truncated
from .inputs import is_int
from .models.qwen35 import Qwen35, state_specs
from .options import EngineOptions
from .speculative import Speculation, SpeculationStats

log = logging.getLogger(__name__)

# float64 is there to check the arithmetic itself against a float64 reference.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class Engine:
    """Serve a Qwen3.5-style hybrid model whose whole execution state lives in one arena.

    Options are keyword arguments of both constructors: see ``EngineOptions``.
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], *, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32, max_seq_len: int = 4096, seeded: Sequence[str] = (),
                 **options: Any) -> None:
        opts = EngineOptions.of(options)
        if not is_int(max_seq_len) or max_seq_len < 1:
            raise InvalidArgument(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if dtype not in _DTYPES:
            raise InvalidArgument(f"dtype {dtype} is not supported ({', '.join(map(str, _DTYPES))})")
        weights = dict(weights)
        draft_vocab = weights.pop(mtp_head.DRAFT_VOCAB, None)
        if draft_vocab is not None:
            mtp_head.check_draft_vocab(cfg, draft_vocab)
        weights_io.check_weights(cfg, weights)   # a tensor that does not fit fails here, not halfway through a prefill
        self.config = cfg
        self.device = inputs.device(device)
        self.dtype = dtype
        self.max_seq_len = int(max_seq_len)
        self.seeded_weights = tuple(seeded)
        # Where generation stops (the tokenizer may add its own eos): from_pretrained adds
        # generation_config.json's.
        self.stop_token_ids: tuple[int, ...] = cfg.eos_token_ids
        self._prefill_chunk = opts.prefill_chunk
        self._flush_denormal = opts.flush_denormal and self.device.type == "cpu"
        self._decode_threads = opts.decode_threads if self.device.type == "cpu" else 0
        self._lock = FairRLock()
        # Everything built here is a normal tensor even when the caller is inside
        # torch.inference_mode(): the capsule calls and the digest thread write into the
        # arena, the pool and the rollback ring outside it, which inference tensors refuse.
        with torch.inference_mode(False):
            try:
                self._build(cfg, weights, opts, draft_vocab)
            except BaseException as exc:
                if hasattr(self, "capsules"):   # its digest thread and device pool: a refusal keeps nothing
                    self.capsules.close()
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
        self.cpu_kernels = opts.cpu_kernels and cpu_backend.serves(self.device, self.dtype)
        if opts.cpu_kernels and not self.cpu_kernels and self.device.type == "cpu" and self.dtype == torch.float32:
            log.warning("the package's C library (src/) is not built: decode runs on the torch reference path; "
                        "build the package with a C compiler (colcon build, or pip install .)")
        self.model = Qwen35(cfg, weights, self.device, self.dtype, self.max_seq_len, cpu_kernels=self.cpu_kernels)
        # The weights as given plus the dtype the engine computes in: the model keeps norms,
        # A_log and dt_bias in fp32 whatever that dtype, so weights equal only once cast to it
        # are not the same model (hashing the cast weights once let such a model's capsule in).
        self.model_fingerprint = weights_io.fingerprint(cfg, weights, self.dtype)
        # 3. allocate the arena (one allocation) and hand the model its views
        self.arena = StateArena(state_specs(cfg, self.max_seq_len, self.dtype), self.device)
        self.model.bind(self.arena)
        self.layout_fingerprint = self.arena.layout_fingerprint()
        depth = opts.rollback_depth
        budgets = {"device": 8 * self.arena.nbytes, "host": 32 * self.arena.nbytes, "disk": 4 << 30}
        budgets.update(opts.budgets or {})
        self.capsules = CapsuleStore(
            Layout(self.arena.regions, self.arena.fixed_bytes, self.layout_fingerprint, self.arena.region_table),
            self.model_fingerprint, self.device, budgets, opts.spill, opts.capsule_dir, lock=self._lock,
            log_kinds=(PREFILL, DECODE, STEP) if cfg.policy else (PREFILL, DECODE), key=opts.capsule_key)
        self._slots = RingSlots(depth, self.arena.fixed_bytes, self.device)
        self._speculation = None
        if cfg.mtp_num_hidden_layers:
            if self.cpu_kernels and opts.max_draft_tokens + 1 > cpu_backend.row_product.MAX_ROWS:
                raise InvalidArgument(f"max_draft_tokens={opts.max_draft_tokens}: a verify of that many drafts "
                                      f"and the main model's token exceeds the row kernel's "
                                      f"{cpu_backend.row_product.MAX_ROWS} rows")
            self._speculation = Speculation(self.arena, self.model, opts.max_draft_tokens, draft_vocab)
        self._state = Boundary()
        # 4. warm up + 5. capture graphs (the warm-up writes state, so zero it after)
        self.cuda_graphs = opts.cuda_graphs and self.device.type == "cuda"
        # Decode over every cache row with a mask (what a graph needs) rather than the live rows:
        # the same tokens, other roundings, so a replay must know which.
        self.fixed_shapes = self.cuda_graphs or opts.static_shapes
        self._obs_in = self._action_out = None

        def step(fn: Callable[[], None]) -> Step:
            # Warm-up runs advance the device position counter: rewound, they write row 0 only,
            # whatever max_seq_len is (an index past the cache is a device-side assert on CUDA).
            return Step(fn, capture=self.cuda_graphs, device=self.device, rewind=self.model.position.zero_)

        with torch.inference_mode():
            self._token_step = step(
                lambda: self.model.token_step(self.model.decode_span(self._state.position, self.fixed_shapes)))
            self._sample_step = step(
                lambda: self.model.token_step(self.model.decode_span(self._state.position, self.fixed_shapes), sampled=True))
            self._policy_step = None
            if cfg.policy:
                self._obs_in = torch.zeros(cfg.obs_dim, device=self.device)
                self._action_out = torch.zeros(cfg.action_dim, device=self.device)
                self._policy_step = step(
                    lambda: self.model.policy_step(self._obs_in, self._action_out,
                                                   self.model.decode_span(self._state.position, self.fixed_shapes)))
            # Fixed-shape verify passes, one per row count: the rows' tokens and logits at fixed
            # addresses and every cache row read under a mask, so that on CUDA each is a graph.
            self._verify_steps: dict[int, Step] = {}
            spec = self._speculation
            if spec is not None and self.fixed_shapes:
                self._verify_in = torch.zeros(spec.max_draft + 1, dtype=torch.int64, device=self.device)
                self._verify_out = torch.zeros(spec.max_draft + 1, cfg.vocab_size, dtype=self.dtype, device=self.device)
                for n in range(2, min(spec.max_draft + 1, self.max_seq_len) + 1):
                    self._verify_steps[n] = step(lambda n=n: self._verify_out[:n].copy_(
                        self.model.verify(self._verify_in[:n], 0, spec.kept, fixed=True)))
            self.arena.buffer.zero_()
            self._state = Boundary(ring=self._slots.saved((), self.arena.buffer, 0))
        if self.cuda_graphs:
            torch.cuda.synchronize(self.device)

    # ---- constructors ------------------------------------------------------------------------
    @classmethod
    def from_config(cls, cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, max_seq_len: int = 4096,
                    mtp_head: str | Path | None = None, **options: Any) -> "Engine":
        """An engine with deterministic seeded weights (the embedded default uses ``ModelConfig.tiny()``).
        ``mtp_head``: a head file (``runtime.mtp_head``) in place of the seeded MTP layer."""
        inputs.check_seed(seed)
        weights = weights_io.seeded_weights(cfg, seed)
        seeded = list(weights_io.expected_shapes(cfg))
        if mtp_head:
            weights, seeded = _with_head(cfg, weights, seeded, mtp_head)
        return cls(cfg, weights, device=device, dtype=dtype, max_seq_len=max_seq_len, seeded=tuple(seeded),
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
        inputs.check_seed(seed)
        cfg, weights, seeded = weights_io.load_checkpoint(path, seed, policy_dims)
        if mtp_head:
            weights, seeded = _with_head(cfg, weights, seeded, mtp_head)
        stops = weights_io.stop_token_ids(path, cfg)
        engine = cls(cfg, weights, device=device, dtype=dtype, max_seq_len=max_seq_len, seeded=seeded, **options)
        engine.stop_token_ids = stops
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
        return self._state.position

    @property
    def lineage(self) -> int:
        """Changes whenever the live state is replaced rather than extended: a restore, a
        rollback that moves back, a reset. A caller committing tokens across several calls
        (a generate goal) checks it under ``lock`` to know that it still extends its own state."""
        return self._state.lineage

    @property
    def rollback_origin(self) -> str:
        """The id of the capsule the last ``rollback(to_position=...)`` started its replay from
        ("" when it started from the ring or from the empty state)."""
        return self._state.origin

    @property
    def sampling_seed(self) -> int:
        """The RNG state of sampled decoding: its seed (0 after a reset; the position is the counter)."""
        with self._lock:
            return int(self.model.rng_seed[0])

    @property
    def rollback_depth(self) -> int:
        return self._slots.depth

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
            return self._digest(self._state.position)

    def _digest(self, position: int) -> str:
        return digest.state_digest(self.capsules.layout.ranges(position), self.arena.read)

    def close(self) -> None:
        """Release the capsule store's memory and its digest thread (disk capsules stay on
        disk). The engine must not be used afterwards; do not call it holding ``lock``."""
        self.capsules.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        # A process that exits with the digest thread mid-hash inside torch can abort.
        self.close()

    def reset(self) -> None:
        """Back to the empty state (position 0), as after construction. Capsules stay."""
        with self._lock:
            self.arena.buffer.zero_()
            self._state = Boundary(lineage=self._state.lineage + 1, ring=self._slots.saved((), self.arena.buffer, 0))

    # ---- work ----------------------------------------------------------------------------------
    @contextmanager
    def _work(self, step: bool = False) -> Iterator[None]:
        """The lock plus inference mode; flush-to-zero on this thread and, for one-row
        steps, the decode thread count, when asked for. Digests that snapshots queued
        start now, alongside this step, not inside the snapshot call (see DigestQueue)."""
        self.capsules.digests.kick()
        with self._lock, torch.inference_mode():
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
            self._check_room(ids.numel())
            self._commit_prefill(ids.to(self.device))
            return _handed_out(self.model.logits()[0].float())

    @contextmanager
    def _whole_or_none(self) -> Iterator[None]:
        """A boundary is committed whole or not at all. Anything raised part-way (Ctrl-C in a
        layer, a later chunk of a long prompt failing) puts back the fixed-size state of the
        last boundary, which the ring holds; rows written past the position are not live."""
        try:
            yield
        except BaseException:
            if self._state.ring:   # empty only after an interrupted restore: the state is unknown then
                self._slots.load(self._state.ring[-1], self.arena.buffer)
            raise

    def _commit_prefill(self, ids: torch.Tensor) -> None:
        at = self._state.position
        with self._whole_or_none():
            for first in range(0, ids.numel(), self._prefill_chunk):
                chunk = ids[first:first + self._prefill_chunk]
                self.model.prefill(chunk, at)
                at += chunk.numel()
            self._commit(PREFILL, ids.numel())

    def _commit_token(self, sampled: bool = False, logged: int | None = None) -> None:
        """One decode boundary: a token chosen now (greedy or ``sampled``), or in a replay the
        ``logged`` one the run committed, not chosen again (it may have been drawn at a
        temperature the log does not keep): the same computation over the same span once
        the token is known, so the same bytes."""
        with self._whole_or_none():
            if logged is None:
                (self._sample_step if sampled else self._token_step)()
            else:
                self.model.commit_token(torch.tensor([logged], device=self.device),
                                        self.model.decode_span(self._state.position, self.fixed_shapes))
            self._commit(DECODE, 1)

    def _commit_step(self, observation: torch.Tensor, finite_only: bool = False) -> None:
        """``finite_only``: raise _NotFinite, the boundary not committed, if the step drove the
        action or the hidden state to NaN or infinity (a replay commits what was committed)."""
        with self._whole_or_none():
            self._obs_in.copy_(observation)
            self._policy_step()
            if finite_only and not (torch.isfinite(self._action_out).all()
                                    and torch.isfinite(self.model.last_hidden).all()):
                raise _NotFinite
            self._commit(STEP, 1)

    def _commit(self, kind: str, count: int, image: torch.Tensor | None = None) -> None:
        """The boundary after ``count`` rows of ``kind``: the log run and the ring slot (no KV),
        which takes the arena's fixed block, or ``image``, a copy of the block at that boundary."""
        state = self._state
        position = state.position + count
        self._state = replace(state, position=position, log=appended(state.log, kind, state.position, count),
                              ring=self._slots.saved(state.ring, self.arena.buffer if image is None else image,
                                                     position))

    def logits(self) -> torch.Tensor:
        """Next-token logits [vocab] of the current state (fp32)."""
        with self._work():
            return _handed_out(self.model.logits()[0].float())

    def generate(self, n: int, *, temperature: float = 0.0, seed: int | None = None,
                 speculative: int | None = None) -> list[int]:
        """Append ``n`` tokens, one committed boundary each; return them. Greedy by default;
        see ``stream`` for ``temperature``, ``seed`` and ``speculative``."""
        return list(self.stream(n, sync_every=0, temperature=temperature, seed=seed, speculative=speculative))

    def stream(self, n: int, sync_every: int = 1, *, temperature: float = 0.0, seed: int | None = None,
               scored: bool = False,
               speculative: int | None = None) -> Iterator[int] | Iterator[tuple[int, float, int]]:
        """Yield tokens as they are committed: greedy, or drawn from softmax(logits / temperature).
        ``scored``: yield (token, margin, position) triples, the margin being the gap between the
        two best scores of the choice in logit units (``sampling.margin``), which a replay on
        another platform needs to tell a near-tie from a real difference, and the position the
        token's boundary left (several tokens of one pass are committed together).

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
        if not is_int(n) or n < 0:
            raise InvalidArgument(f"number of tokens must be an int >= 0, got {n!r}")
        n = int(n)
        if not is_int(sync_every) or sync_every < 0:
            raise InvalidArgument(f"sync_every must be an int >= 0, got {sync_every!r}")
        temperature = inputs.temperature(temperature)
        if seed is not None:
            inputs.check_seed(seed)
        drafts = self.check_speculative(speculative)
        with self._lock:
            self._check_room(n)
            lineage = self._state.lineage
        return self._stream(n, sync_every, lineage, temperature, seed, scored, drafts)

    def check_speculative(self, speculative: int | None) -> int:
        """The drafts per pass ``speculative`` asks for (0: none), or InvalidArgument: what
        ``stream`` checks first, for a caller to check before it commits anything else."""
        if speculative is None:
            return 0
        if not is_int(speculative) or speculative < 1:
            raise InvalidArgument(f"speculative must be None (off) or an int >= 1 (drafts per pass), "
                                  f"got {speculative!r}")
        if self._speculation is None:
            raise InvalidArgument("speculative decoding needs an MTP layer, and this model has none "
                                  "(mtp_num_hidden_layers=0)")
        if speculative > self._speculation.max_draft:
            raise InvalidArgument(f"speculative={speculative} drafts more than a verify holds "
                                  f"(max_draft_tokens={self._speculation.max_draft})")
        return int(speculative)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """Speculative decoding's counts so far (None without an MTP layer); a copy."""
        with self._lock:
            return None if self._speculation is None else replace(self._speculation.stats)

    @property
    def speculation(self) -> Speculation | None:
        """Speculative decoding's drafter and switch-off rule (None without an MTP layer)."""
        return self._speculation

    def _stream(self, n: int, sync_every: int, lineage: int, temperature: float, seed: int | None,
                scored: bool, drafts: int) -> Iterator[int] | Iterator[tuple[int, float, int]]:
        # Each step copies its token into a device-side list under the lock, and reading
        # it back costs one sync per ``sync_every`` tokens, not per token. Another caller
        # may restore or roll back between two steps: the stream then stops rather than
        # go on from a state it did not build.
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        margins = torch.empty(n if scored else 0, dtype=torch.float64, device=self.device)
        ends: list[int] = []   # the position after each token, when scored

        def read_back(start: int, end: int) -> list:
            tokens = out[start:end].tolist()
            return list(zip(tokens, margins[start:end].tolist(), ends[start:end])) if scored else tokens

        read = done = 0
        follows = None   # the last pass's logits for the next row, while the state is still its own
        while done < n:
            with self._work(step=True):
                replaced = self._state.lineage != lineage
                if not replaced:
                    self._check_room(1)
                    if seed is not None and done == 0:
                        self.model.rng_seed.fill_(int(seed))
                    if temperature > 0:   # set per step: another caller's stream may have set its own
                        self.model.temperature.fill_(temperature)
                    passed = None
                    if drafts and self._speculation.wanted():
                        passed = self._speculative_pass(drafts, n - done, temperature > 0, follows)
                    if passed is None:
                        self._commit_token(sampled=temperature > 0)
                        out[done] = self.model.tokens[self._state.position - 1]
                        if scored:
                            margins[done] = self.model.margin[0]
                        count, follows = 1, None
                    else:
                        tokens, chosen_margins, follows = passed
                        count = tokens.shape[0]
                        out[done:done + count] = tokens
                        if scored:
                            margins[done:done + count] = chosen_margins
                    if scored:
                        ends.extend(range(self._state.position - count + 1, self._state.position + 1))
            if replaced:   # yielded outside the lock: the consumer may take its time
                yield from read_back(read, done)
                raise Preempted(f"a restore or rollback (or a reset) replaced the live state after {done} of "
                                f"{n} tokens; the stream stopped there")
            done += count
            if sync_every and done - read >= sync_every:
                yield from read_back(read, done)
                read = done
        if read < n:
            yield from read_back(read, n)

    def _speculative_pass(self, drafts: int, left: int, sampled: bool,
                          follows: tuple | None) -> tuple[torch.Tensor, torch.Tensor, tuple] | None:
        """One pass of up to ``drafts`` drafts and their verify, committing 1 + the accepted ones:
        (tokens, margins, the logits that follow them) or None when no draft fits (at the end
        of the request or of the context), the caller then decodes one token plainly."""
        state, spec, model = self._state, self._speculation, self.model
        at = state.position
        k = min(drafts, left - 1, self.max_seq_len - at - 1)
        if k < 1:
            return None
        with self._whole_or_none():
            if follows is not None and follows[0] == (state.lineage, at):
                logits = follows[1]
            else:   # another caller committed meanwhile: the logits of the state as it is
                logits = model.logits()
            first, first_margin = self._choose(logits, at, sampled)
            draft = spec.drafter(first, at, k)
            rows = self._verify(torch.cat([first, draft]), at)
            chosen = [self._choose(rows[i:i + 1], at + 1 + i, sampled) for i in range(k + 1)]
            agree = (draft == torch.cat([c[0] for c in chosen[:k]])).tolist()
            accepted = agree.index(False) if False in agree else k
            if accepted < k:   # back to the boundary after the last accepted row
                self.arena.buffer[:self.arena.fixed_bytes].copy_(spec.images[accepted])
        for i in range(accepted + 1):
            self._commit(DECODE, 1, image=spec.images[i])
        spec.record(k, accepted)
        tokens = torch.cat([first, draft[:accepted]])
        margins = torch.cat([first_margin] + [c[1] for c in chosen[:accepted]])
        return tokens, margins, ((self._state.lineage, self._state.position), rows[accepted:accepted + 1])

    def _verify(self, tokens: torch.Tensor, at: int) -> torch.Tensor:
        """``Qwen35.verify`` of ``tokens`` at position ``at``: its fixed-shape step (a graph on CUDA)
        where the engine decodes with fixed shapes, else eagerly over the live rows."""
        step = self._verify_steps.get(tokens.shape[0])
        if step is None:
            return self.model.verify(tokens, at, self._speculation.kept, self.fixed_shapes)
        self._verify_in[:tokens.shape[0]].copy_(tokens)
        step()
        return self._verify_out[:tokens.shape[0]].clone()   # the next pass writes the same rows

    def _choose(self, logits: torch.Tensor, position: int, sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The token [1] and its margin [1] that decode picks from ``logits`` [1, vocab] for the
        row at ``position``: as ``Qwen35.token_step`` does, with the same RNG counter."""
        model = self.model
        if not sampled:
            return logits.argmax(-1), sampling.margin(logits[0])
        counter = torch.tensor([position], dtype=torch.int64, device=self.device)
        scores = sampling.scores(logits, model.temperature, model.rng_seed, counter, model.vocab_index)
        return scores.argmax(-1, keepdim=True), sampling.margin(scores) * model.temperature

    def append(self, token: int, *, seed: int | None = None) -> None:
        """Commit ``token`` as the next decode boundary, as if decode had chosen it (the same
        bytes as that decode): a replay on another platform continues from the recorded token
        where its own choice, at a near-tie, came out different. ``seed`` sets the sampling
        RNG state first, as ``stream`` does."""
        if not is_int(token) or not 0 <= int(token) < self.config.vocab_size:
            raise InvalidArgument(f"token must be an int in [0, {self.config.vocab_size}), got {token!r}")
        if seed is not None:
            inputs.check_seed(seed)
        with self._work(step=True):
            self._check_room(1)
            if seed is not None:
                self.model.rng_seed.fill_(int(seed))
            self._commit_token(logged=int(token))

    def step(self, observation: Sequence[float] | torch.Tensor) -> torch.Tensor:
        """Policy mode: one observation vector in, one action vector out; commits a boundary."""
        cfg = self.config
        if not cfg.policy:
            raise InvalidArgument("this model has no policy heads (obs_dim = action_dim = 0)")
        obs = inputs.observation(observation, cfg.obs_dim)
        with self._work(step=True):
            self._check_room(1)
            try:
                # Finite inputs near the float32 limit (a common "unknown" sentinel) can overflow
                # inside the model; committed, every later action would be NaN.
                self._commit_step(obs, finite_only=True)
            except _NotFinite:
                # The step's own rows are past the position, but fixed-shape decode (and the
                # CUDA graph) reads every row and masks scores: 0 x NaN would still be NaN.
                for region in self.arena.regions:
                    if region.per_token:
                        self.arena[region.name][self._state.position].zero_()
                raise InvalidArgument(f"observation (largest magnitude {obs.abs().max().item():.3g}) drove the "
                                      "state to NaN or infinity; the step was undone") from None
            return _handed_out(self._action_out.cpu())

    # ---- capsules --------------------------------------------------------------------------------
    def snapshot(self, name: str | None = None, tier: str = "device", pin: bool = False) -> CapsuleInfo:
        """Capture the whole state at the current committed boundary as a new capsule.

        Per-token rows that the live state shares with the capsule it descends
        from (the last one restored or taken) are referenced, not copied. The
        digest is computed in the background; ``capsules.get(id)`` waits for it.
        """
        with self._lock, self.capsules.operation():  # copies only: no inference mode or thread settings
            state = self._state
            plan = self.capsules.plan_snapshot(state.position, name=name, tier=tier, pin=pin,
                                               parent=state.base[0].info.id if state.base else "",
                                               base=state.base, log_runs=state.log)
            try:
                plan.copy(self.arena.buffer)
                record = self.capsules.add(plan)
            except BaseException:   # a failed snapshot keeps no bytes
                self.capsules.discard(plan)
                raise
            self._state = replace(state, base=(record, state.position))
            return record.info

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
            if regions is not None:
                return self._restore_groups(record, regions, verify)
            state = self._state
            # Descending from a capsule, the live state holds that capsule's per-token rows
            # [0:p] (KV is append-only); those this capsule shares with it are not copied.
            keep = 0
            if state.base is not None:
                base, rows = state.base
                keep = rows if base is record else self.capsules.shared_rows(record, base,
                                                                             min(rows, record.info.position))
            backup = None
            if verify:
                self.capsules.verify(record)
                backup = self.arena.buffer.clone()
            plan = self.capsules.plan_restore(record, keep)   # a refusal here has changed nothing
            try:
                plan.copy(self.arena.buffer)
                if verify and self._digest(plan.position) != record.info.digest:
                    raise _VerifyFailed
                self._state = Boundary(position=plan.position, lineage=state.lineage + 1, log=plan.log,
                                       base=(record, plan.position),
                                       ring=self._slots.saved((), self.arena.buffer, plan.position))
            except _VerifyFailed:
                self.arena.buffer.copy_(backup)
                raise CorruptCapsule(f"capsule {record.info.id}: live state after restore does not match its "
                                     "digest") from None
            except BaseException:
                # Interrupted part-way: the arena is neither state, so no boundary the ring holds
                # matches it and its rows are no capsule's (the next restore copies them all).
                self._state = replace(state, lineage=state.lineage + 1, base=None, ring=())
                raise
            return record.info

    def _restore_groups(self, record, regions: Sequence[str], verify: bool) -> CapsuleInfo:
        groups = list(regions) if isinstance(regions, (list, tuple)) else None
        if not groups or not all(isinstance(g, str) and g in GROUPS for g in groups):
            raise InvalidCapsuleRequest(f"regions must be a list of groups among {list(GROUPS)}, got {shown(regions)}")
        if verify:
            raise InvalidCapsuleRequest("verify needs a full restore (regions=None)")
        plan = self.capsules.plan_restore(record, groups=groups)
        lineage = self._state.lineage + 1
        try:
            plan.copy(self.arena.buffer)
            self.model.position.fill_(plan.position)
            self._state = Boundary(position=plan.position, lineage=lineage, log=plan.log,
                                   ring=self._slots.saved((), self.arena.buffer, plan.position))
        except BaseException:
            self._state = replace(self._state, lineage=lineage, base=None, ring=())
            raise
        return record.info

    def rollback(self, steps: int = 1, to_position: int | None = None) -> int:
        """Go back ``steps`` committed boundaries, or exactly to token position ``to_position``.

        Steps come from the ring (fixed-size regions only; KV is append-only, so
        only the position moves back there). ``to_position`` restores the newest
        kept boundary at or before it, then replays the logged inputs up to it.
        Returns the new position.
        """
        with self._work():
            if to_position is not None:
                return self._rollback_to(to_position)
            if not is_int(steps) or steps < 0:
                raise InvalidCapsuleRequest(f"steps must be an int >= 0, got {steps!r}")
            steps = int(steps)
            state = self._state
            kept = max(0, len(state.ring) - 1)
            if steps > kept:
                raise InvalidCapsuleRequest(f"cannot roll back {steps} boundaries: {kept} are kept "
                                            f"(rollback_depth={self._slots.depth})")
            if steps:
                with self._whole_or_none():
                    self._state = self._went_back(state, len(state.ring) - 1 - steps, state.lineage + 1)
            return self._state.position

    def _went_back(self, state: Boundary, index: int, lineage: int) -> Boundary:
        """Load ring entry ``index`` into the arena; the state that is then."""
        kept = state.ring[index]
        self._slots.load(kept, self.arena.buffer)
        base = None if state.base is None else (state.base[0], min(state.base[1], kept.position))
        return replace(state, position=kept.position, lineage=lineage, log=truncated(state.log, kept.position),
                       ring=state.ring[:index + 1], base=base, origin="")

    def _rollback_to(self, target: int) -> int:
        state = self._state
        if not is_int(target) or not 0 <= target <= state.position:
            raise InvalidCapsuleRequest(f"to_position must be an int in [0, {state.position}], got {target!r}")
        target = int(target)
        tokens = self.model.tokens[:target].tolist()
        seeds = self.model.seeds[:target].tolist()
        observations = None if self.model.observations is None else self.model.observations[:target].clone()
        # What the replay may change, kept so that a failed one changes nothing: the fixed
        # block, and (taken below, once the start is known) the rows it rewrites.
        fixed = self.arena.buffer[:self.arena.fixed_bytes].clone()
        index = next((i for i in range(len(state.ring) - 1, -1, -1) if state.ring[i].position <= target), None)
        origin = None if index is not None else self._passed_capsule(state, target)
        plan = None
        if origin is not None:
            # Older than the ring, but the run passed this capsule's boundary on the way: a nearer
            # start than the empty state. Its rows are the live ones, so only its fixed block is
            # copied. A disk capsule that can no longer be read is only a lost shortcut: the
            # replay starts from the empty state instead.
            try:
                plan = self.capsules.plan_restore(origin, keep_rows=origin.info.position)
            except CapsuleError as exc:
                log.warning("rollback: capsule %s unreadable (%s); replaying from the empty state",
                            origin.info.id, exc)
        if index is not None:
            start = self._went_back(state, index, state.lineage)
        elif plan is not None:
            plan.copy(self.arena.buffer)
            at = origin.info.position
            start = replace(state, position=at, log=origin.log, base=(origin, at), origin=origin.info.id,
                            ring=self._slots.saved((), self.arena.buffer, at))
        else:  # older than the ring: start from the empty state; the history rows stay
            self.arena.buffer[:self.arena.fixed_bytes].zero_()
            start = replace(state, position=0, log=(), base=None if state.base is None else (state.base[0], 0),
                            origin="", ring=self._slots.saved((), self.arena.buffer, 0))
        rows = [(view, view[start.position:target].clone()) for r, view in self.arena.live_views(self.max_seq_len)
                if r.per_token]
        try:
            self._state = start
            for kind, first, count in runs_between(state.log, start.position, target):
                self._replay(kind, first, count, tokens, seeds, observations)
            if self._state.position != target or self.model.tokens[:target].tolist() != tokens:
                raise FlashRTError(f"replay to position {target} did not reproduce the logged run "
                                   f"(it reached position {self._state.position})")
        except BaseException:
            self.arena.buffer[:self.arena.fixed_bytes].copy_(fixed)
            for view, saved in rows:
                view[start.position:target].copy_(saved)
            # The steps back the ring held may be overwritten: the state is the one before, alone.
            self._state = replace(state, origin="", ring=self._slots.saved((), self.arena.buffer, state.position))
            raise
        if target < state.position:   # back to where it was: the same state, the same lineage
            self._state = replace(self._state, lineage=state.lineage + 1)
        return self._state.position

    def _passed_capsule(self, state: Boundary, target: int):
        """The capsule the live state descends from, if it is still kept and the run went
        through its boundary at or before ``target`` (its rows are still all live)."""
        if state.base is None:
            return None
        record, rows = state.base
        at = record.info.position
        if not 0 < at <= min(target, rows) or not self.capsules.keeps(record):
            return None
        return record

    def _replay(self, kind: str, start: int, count: int, tokens: list[int], seeds: list[int],
                observations) -> None:
        """Commit the logged rows [start, start + count) again, each with the sampling seed it
        was committed with (a prefill's rows share one): the RNG state ends as the run had it."""
        if kind == PREFILL:
            self.model.rng_seed.fill_(seeds[start])
            self._commit_prefill(torch.tensor(tokens[start:start + count], device=self.device))
            return
        for row in range(start, start + count):
            self.model.rng_seed.fill_(seeds[row])
            if kind == DECODE:
                self._commit_token(logged=tokens[row])
            else:
                self._commit_step(observations[row])

    # ---- checks --------------------------------------------------------------------------------
    def _check_room(self, n: int) -> None:
        if self._state.position + n > self.max_seq_len:
            # Full: nothing at all fits until room is freed. Otherwise the request is too long.
            error = ContextFull if self._state.position >= self.max_seq_len else InvalidArgument
            raise error(
                f"{n} more positions would exceed max_seq_len={self.max_seq_len} "
                f"(position is {self._state.position})")


def _with_head(cfg: ModelConfig, weights: dict[str, torch.Tensor], seeded: Sequence[str],
               path: str | Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``weights`` with the MTP head file at ``path`` in place of their ``mtp.*``."""
    head, meta = mtp_head.load(path, cfg)
    base = meta.get("distilled_from")
    if base and base != mtp_head.base_fingerprint(cfg, weights):
        log.warning("MTP head %s was distilled from another model (%s): its drafts will rarely be accepted",
                    path, base)
    return weights | head, [name for name in seeded if not name.startswith("mtp.")]


class _NotFinite(Exception):
    """A policy step gave NaN or infinity (never leaves the engine)."""


class _VerifyFailed(Exception):
    """A verified restore's live state does not match the capsule's digest (never leaves the engine)."""


def _handed_out(t: torch.Tensor) -> torch.Tensor:
    """A copy the caller owns, as a normal tensor: what runs under inference mode makes
    inference tensors, which refuse in-place changes (``logits.div_(t)``) outside it."""
    with torch.inference_mode(False):
        return t.clone()
