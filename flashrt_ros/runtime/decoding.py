"""The computation that advances the arena, and nothing else: prefill in chunks, one decode or
policy step (a captured CUDA graph where the engine has them), and the speculative pass.

Each call leaves the arena as after the rows it computed and returns what it computed
(tokens, margins, per-row states). Which boundaries that makes, and undoing a call that
fails part-way, is ``live_state.LiveState``'s: nothing here knows about boundaries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import InvalidArgument
from . import sampling
from .arena import StateArena
from .graph import Step
from .inputs import is_int
from .models.qwen35 import Qwen35
from .sampling import GREEDY, Sampling
from .speculative import Speculation


@dataclass(frozen=True, slots=True)
class Pass:
    """What one speculative pass keeps: the tokens [m] (the main model's own choice, then
    the accepted drafts), each choice's margin [m], the fixed-size state after each token
    [m, fixed_bytes] (the arena holds the last), the logits [1, vocab] that follow the last
    token, and ``end``, the position after it."""

    tokens: torch.Tensor
    margins: torch.Tensor
    states: torch.Tensor
    follows: torch.Tensor
    end: int


class Decoder:
    """The steps of one model over one arena. ``fixed_shapes``: every step reads all cache rows
    under a mask (what a graph needs; other roundings than the live rows, the same tokens).
    ``max_draft`` > 0 (a model with an MTP layer): speculative passes of up to that many drafts."""

    def __init__(self, model: Qwen35, arena: StateArena, *, max_seq_len: int, prefill_chunk: int,
                 fixed_shapes: bool, cuda_graphs: bool, max_draft: int = 0,
                 draft_vocab: torch.Tensor | None = None) -> None:
        self.model, self.arena = model, arena
        self.prefill_chunk, self.fixed_shapes = prefill_chunk, fixed_shapes
        self.device = arena.device
        self._at = 0   # the position an eager step's span starts from (graphs read the device counter)
        cfg = model.cfg

        def step(fn: Callable[[], None]) -> Step:
            # Warm-up runs advance the device position counter: rewound, they write row 0 only,
            # whatever max_seq_len is (an index past the cache is a device-side assert on CUDA).
            return Step(fn, capture=cuda_graphs, device=self.device, rewind=model.position.zero_)

        self._greedy = step(lambda: model.token_step(self._span()))
        self._sampled = step(lambda: model.token_step(self._span(), sampled=True))
        self._cut = step(lambda: model.token_step(self._span(), sampled=True, cut=True))
        self.observation = self.action = self._policy = None
        if cfg.policy:
            self.observation = torch.zeros(cfg.obs_dim, device=self.device)
            self.action = torch.zeros(cfg.action_dim, device=self.device)
            self._policy = step(lambda: model.policy_step(self.observation, self.action, self._span()))
        self.speculation = Speculation(model, max_draft, draft_vocab) if max_draft else None
        # Fixed-shape verify passes, one per row count: the rows' tokens and logits at fixed
        # addresses and every cache row read under a mask, so that on CUDA each is a graph.
        self.verify_steps: dict[int, Step] = {}
        if self.speculation is not None and fixed_shapes:
            rows = max_draft + 1
            self._verify_in = torch.zeros(rows, dtype=torch.int64, device=self.device)
            self._verify_out = torch.zeros(rows, cfg.vocab_size, dtype=model.dtype, device=self.device)
            for n in range(2, min(rows, max_seq_len) + 1):
                self.verify_steps[n] = step(lambda n=n: self._verify_out[:n].copy_(
                    model.verify(self._verify_in[:n], 0, fixed=True)[0]))
        arena.buffer.zero_()   # the warm-ups wrote state
        if cuda_graphs:
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Drop the steps and the drafter: the steps' closures hold this decoder, and the
        drafter (a bound method) its Speculation, cycles that keep the model and every weight
        until a garbage collection. Dropped, the weights go with the engine's last reference.
        Nothing may step afterwards (``Engine.close`` refuses it)."""
        self._greedy = self._sampled = self._cut = self._policy = None
        self.verify_steps.clear()
        if self.speculation is not None:
            self.speculation.drafter = None

    def drafts_for(self, speculative: int | None) -> int:
        """The drafts per pass ``speculative`` asks for (None: 0, no speculation), or InvalidArgument."""
        if speculative is None:
            return 0
        if not is_int(speculative) or speculative < 1:
            raise InvalidArgument(f"speculative must be None (off) or an int >= 1 (drafts per pass), "
                                  f"got {speculative!r}")
        if self.speculation is None:
            raise InvalidArgument("speculative decoding needs an MTP layer, and this model has none "
                                  "(mtp_num_hidden_layers=0)")
        if speculative > self.speculation.max_draft:
            raise InvalidArgument(f"speculative={speculative} drafts more than a verify holds "
                                  f"(max_draft_tokens={self.speculation.max_draft})")
        return int(speculative)

    @property
    def steps(self) -> dict[str, Step]:
        """Every step a CUDA graph captures where the engine has graphs, by name: decode greedy,
        sampled and within a top-k / top-p cut, the policy step (a policy model), and a verify
        pass per row count ("verify 2" and on; speculative decoding at fixed shapes)."""
        named = {"greedy": self._greedy, "sampled": self._sampled, "cut": self._cut}
        if self._policy is not None:
            named["policy"] = self._policy
        return named | {f"verify {n}": verify for n, verify in self.verify_steps.items()}

    @property
    def token_graph(self) -> Step:
        """The greedy decode step (its ``captures`` count says how often it was captured)."""
        return self._greedy

    def _span(self):
        return self.model.decode_span(self._at, self.fixed_shapes)

    def prefill(self, ids: torch.Tensor, at: int) -> None:
        """The rows of ``ids`` from position ``at``, ``prefill_chunk`` rows per forward."""
        for first in range(0, ids.numel(), self.prefill_chunk):
            chunk = ids[first:first + self.prefill_chunk]
            self.model.prefill(chunk, at + first)

    def token(self, at: int, how: Sampling = GREEDY) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode the row at ``at`` as ``how`` chooses (its values written with
        ``Qwen35.use_sampling``): (its token [1], the choice's margin [1]), on the device,
        valid until the next step."""
        self._at = at
        (self._cut if how.truncated else self._sampled if how.sampled else self._greedy)()
        return self.model.tokens[at:at + 1], self.model.margin

    def logged_token(self, at: int, token: int) -> None:
        """The row at ``at`` with ``token`` known, not chosen again (a replay's logged token, which
        may have been drawn at a temperature the log does not keep): the same computation over
        the same span as the decode that chose it, so the same bytes."""
        self.model.commit_token(torch.tensor([token], device=self.device),
                                self.model.decode_span(at, self.fixed_shapes))

    def policy(self, at: int, observation: torch.Tensor) -> torch.Tensor:
        """The policy step at ``at``: the action [action_dim], on the device, valid until the next step."""
        self.observation.copy_(observation)
        self._at = at
        self._policy()
        return self.action

    def finite(self) -> bool:
        """Whether the last policy step's action and hidden state are finite."""
        return bool(torch.isfinite(self.action).all() and torch.isfinite(self.model.last_hidden).all())

    def speculate(self, at: int, drafts: int, how: Sampling, logits: torch.Tensor | None) -> Pass:
        """One pass at position ``at``: the main model's token (from ``logits`` [1, vocab], the
        ones that follow the state, or computed when None), ``drafts`` drafts of the MTP layer,
        one verify of them all, and the arena back to the state after the last accepted row."""
        model, spec = self.model, self.speculation
        if logits is None:
            logits = model.logits()
        first, first_margin = self.choose(logits, at, how)
        draft = spec.drafter(first, at, drafts)
        rows, states = self._verify(torch.cat([first, draft]), at)
        chosen = [self.choose(rows[i:i + 1], at + 1 + i, how) for i in range(drafts + 1)]
        agree = (draft == torch.cat([c[0] for c in chosen[:drafts]])).tolist()
        accepted = agree.index(False) if False in agree else drafts
        if accepted < drafts:
            self.arena.buffer[:self.arena.fixed_bytes].copy_(states[accepted])
        spec.record(drafts, accepted)
        return Pass(tokens=torch.cat([first, draft[:accepted]]),
                    margins=torch.cat([first_margin] + [c[1] for c in chosen[:accepted]]),
                    states=states[:accepted + 1], follows=rows[accepted:accepted + 1], end=at + accepted + 1)

    def _verify(self, tokens: torch.Tensor, at: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``Qwen35.verify`` of ``tokens`` at ``at``: its fixed-shape step (a graph on CUDA) where
        steps have fixed shapes, else eagerly over the live rows; (logits, per-row states)."""
        n = tokens.shape[0]
        step = self.verify_steps.get(n)
        if step is None:
            return self.model.verify(tokens, at, self.fixed_shapes)
        self._verify_in[:n].copy_(tokens)
        step()
        return self._verify_out[:n].clone(), self.model.verify_states[:n]   # the next pass writes the same rows

    def choose(self, logits: torch.Tensor, position: int, how: Sampling) -> tuple[torch.Tensor, torch.Tensor]:
        """The token [1] and its margin [1] that decode picks from ``logits`` [1, vocab] for the
        row at ``position``: as ``Qwen35.token_step`` does, with the same RNG counter."""
        model = self.model
        if not how.sampled:
            return logits.argmax(-1), sampling.margin(logits[0])
        counter = torch.tensor([position], dtype=torch.int64, device=self.device)
        scores = sampling.scores(logits, model.temperature, model.rng_seed, counter, model.vocab_index,
                                 model.cut if how.truncated else None)
        return scores.argmax(-1, keepdim=True), sampling.margin(scores) * model.temperature
