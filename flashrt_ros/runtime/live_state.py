"""The live state: its ``Boundary`` value, the ring of fixed blocks behind it, and the moves that
advance it (commits), take it back (the ring, a replay of the log to a position), replace it
(a capsule's restore) or keep it (a snapshot).

Each move writes the arena, then assigns the next ``Boundary`` from one of ``history``'s
transitions. A move that fails part-way leaves the arena and the value as the last committed
boundary had them (a restore interrupted mid-copy, whose arena is neither state, says so
with ``history.unknown``). The caller holds the engine lock, and has checked the request;
the capsule store plans each snapshot and restore, and the moves here carry the plans out.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import torch

from ..capsule import CapsuleInfo, CapsuleStore
from ..capsule.errors import CapsuleError, CorruptCapsule
from ..capsule.plans import RestorePlan, SnapshotPlan
from ..digest import state_digest
from ..errors import ContextFull, FlashRTError, InvalidArgument
from .arena import StateArena
from .decoding import Decoder, Pass
from .history import (DECODE, PREFILL, STEP, Base, Boundary, RingSlots, between, committed, moved, renewed,
                      snapshotted, stepped_back, unknown)
from .sampling import GREEDY, Sampling

log = logging.getLogger(__name__)


class _VerifyFailed(Exception):
    """A verified restore's live state does not match the capsule's digest (never leaves ``restore``)."""


class LiveState:
    """The engine's live state and its moves, over one arena, one decoder and the capsule store
    that keeps the arena's capsules; ``max_seq_len`` positions fit, ``depth`` boundaries back."""

    def __init__(self, arena: StateArena, decoder: Decoder, capsules: CapsuleStore, depth: int,
                 max_seq_len: int) -> None:
        self.arena, self.decoder, self.model, self.capsules = arena, decoder, decoder.model, capsules
        self.max_seq_len = max_seq_len
        self.slots = RingSlots(depth, arena.fixed_bytes, arena.device)
        self.state = Boundary(ring=self.ring_at(0))

    def ring_at(self, position: int) -> tuple:
        """A ring of the arena's fixed block alone, as the boundary at ``position``."""
        return self.slots.saved((), self.arena.buffer, position)

    def check_room(self, n: int) -> None:
        """Whether ``n`` more positions fit: ContextFull when the state is full (nothing fits until
        room is freed), InvalidArgument when the request alone is too long."""
        position = self.state.position
        if position + n > self.max_seq_len:
            error = ContextFull if position >= self.max_seq_len else InvalidArgument
            raise error(f"{n} more positions would exceed max_seq_len={self.max_seq_len} (position is {position})")

    def digest(self) -> str:
        """The live state's digest (``flashrt_ros.digest``): the one its capsule would carry."""
        return self._digest(self.state.position)

    def _digest(self, position: int) -> str:
        return state_digest(self.capsules.layout.ranges(position), self.arena.read)

    # ---- forward ---------------------------------------------------------------------------------
    @contextmanager
    def committed_whole(self) -> Iterator[None]:
        """A boundary is committed whole or not at all. Anything raised part-way (Ctrl-C in a
        layer, a later chunk of a long prompt failing) puts back the fixed-size state of the
        last boundary, which the ring holds; rows written past the position are not live."""
        try:
            yield
        except BaseException:
            if self.state.ring:   # empty only after an interrupted restore: the state is unknown then
                self.slots.load(self.state.ring[-1], self.arena.buffer)
            raise

    def commit(self, kind: str, count: int, image: torch.Tensor | None = None) -> None:
        """The boundary after ``count`` rows of ``kind``, its ring slot taken from the arena's
        fixed block or from ``image``, a copy of the block at that boundary."""
        state = self.state
        ring = self.slots.saved(state.ring, self.arena.buffer if image is None else image, state.position + count)
        self.state = committed(state, kind, count, ring)

    def prefill(self, ids: torch.Tensor) -> None:
        with self.committed_whole():
            self.decoder.prefill(ids, self.state.position)
            self.commit(PREFILL, ids.numel())

    def token(self, how: Sampling = GREEDY) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode boundary, chosen as ``how`` says: (the token [1], its margin [1]) on the device."""
        with self.committed_whole():
            chosen = self.decoder.token(self.state.position, how)
            self.commit(DECODE, 1)
        return chosen

    def logged_token(self, token: int) -> None:
        """One decode boundary of a token known beforehand (``Decoder.logged_token``)."""
        with self.committed_whole():
            self.decoder.logged_token(self.state.position, token)
            self.commit(DECODE, 1)

    def step(self, observation: torch.Tensor, finite_only: bool = False) -> torch.Tensor:
        """One policy boundary; its action [action_dim] on the device. ``finite_only``: raise
        InvalidArgument, nothing committed, if the step drove the action or the hidden state to
        NaN or infinity (a replay commits what was committed)."""
        with self.committed_whole():
            action = self.decoder.policy(self.state.position, observation)
            if finite_only and not self.decoder.finite():
                # The step's own rows are past the position, but fixed-shape decode (and the
                # CUDA graph) reads every row and masks scores: 0 x NaN would still be NaN.
                for region in self.arena.regions:
                    if region.per_token:
                        self.arena[region.name][self.state.position].zero_()
                raise InvalidArgument(f"observation (largest magnitude {observation.abs().max().item():.3g}) "
                                      "drove the state to NaN or infinity; the step was undone")
            self.commit(STEP, 1)
        return action

    def speculative_pass(self, drafts: int, how: Sampling, last: Pass | None) -> Pass:
        """A pass of ``drafts`` drafts (``Decoder.speculate``), each token it keeps its own boundary.
        ``last``: the previous pass, whose logits follow its end."""
        at = self.state.position
        with self.committed_whole():   # interrupted between two commits: back to the last one made
            done = self.decoder.speculate(at, drafts, how, last.follows if last and last.end == at else None)
            for image in done.states:
                self.commit(DECODE, 1, image=image)
        return done

    # ---- capsules --------------------------------------------------------------------------------
    def snapshot(self, plan: SnapshotPlan) -> CapsuleInfo:
        """The live state copied into the capsule ``plan`` lays out, which the state then descends
        from. A copy or an add that fails keeps no bytes and changes nothing."""
        try:
            plan.copy(self.arena.buffer)
            info = self.capsules.add(plan).info
        except BaseException:
            self.capsules.discard(plan)
            raise
        self.state = snapshotted(self.state, info.id)
        return info

    def restore(self, plan: RestorePlan, capsule: CapsuleInfo, verify: bool = False, partial: bool = False) -> None:
        """The state of ``capsule``, whose copies ``plan`` holds, as a replacement of this one.

        ``verify``: the live state is hashed after the copy; on a mismatch with the capsule's
        digest the arena is put back as it was and CorruptCapsule raised. ``partial``: the plan
        copies only some groups (an ablation): the position is set, and the state descends from
        no capsule. Anything else raised part-way leaves the state ``unknown``."""
        state = self.state
        backup = self.arena.buffer.clone() if verify else None
        try:
            plan.copy(self.arena.buffer)
            if partial:   # the position counter is in the meta group
                self.model.position.fill_(plan.position)
            if verify and self._digest(plan.position) != capsule.digest:
                raise _VerifyFailed
            base = None if partial else Base(capsule.id, plan.position)
            self.state = renewed(moved(state, plan.position, plan.log, self.ring_at(plan.position), base))
        except _VerifyFailed:
            self.arena.buffer.copy_(backup)
            raise CorruptCapsule(f"capsule {capsule.id}: live state after restore does not match its digest") from None
        except BaseException:
            self.state = unknown(state)
            raise

    # ---- back ------------------------------------------------------------------------------------
    def reset(self) -> None:
        """The empty state, as a replacement of this one."""
        self.arena.buffer.zero_()
        self.state = renewed(moved(self.state, 0, (), self.ring_at(0)))

    def back(self, steps: int) -> None:
        """``steps`` boundaries back along the ring (at most ``len(ring) - 1``)."""
        if steps:
            with self.committed_whole():
                self.state = renewed(self._stepped_back(self.state, len(self.state.ring) - 1 - steps))

    def _stepped_back(self, state: Boundary, index: int) -> Boundary:
        self.slots.load(state.ring[index], self.arena.buffer)
        return stepped_back(state, index)

    def replay_to(self, target: int) -> None:
        """Back to position ``target`` <= the position: from the nearest kept boundary at or before
        it, the logged inputs committed again. A replay that fails changes nothing."""
        state = self.state
        logged = self._logged_inputs(target)
        # What the replay may change, kept so that a failed one changes nothing: the fixed
        # block, and (once the start is known) the rows it rewrites.
        fixed = self.arena.buffer[:self.arena.fixed_bytes].clone()
        rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            start = self._replay_start(state, target)
            rows = [(view[start.position:target], view[start.position:target].clone())
                    for r, view in self.arena.live_views(self.model.rows.numel()) if r.per_token]
            self.state = start
            for kind, first, count in between(state.log, start.position, target):
                self._replay(kind, first, count, *logged)
            if self.state.position != target or self.model.tokens[:target].tolist() != logged[0]:
                raise FlashRTError(f"replay to position {target} did not reproduce the logged run "
                                   f"(it reached position {self.state.position})")
        except BaseException:
            self.arena.buffer[:self.arena.fixed_bytes].copy_(fixed)
            for view, saved in rows:
                view.copy_(saved)
            # The steps back the ring held may be overwritten: the state is the one before, alone.
            self.state = moved(state, state.position, state.log, self.ring_at(state.position), state.base)
            raise
        if target < state.position:   # back to where it was: the same state, the same lineage
            self.state = renewed(self.state)

    def _logged_inputs(self, end: int) -> tuple[list[int], list[int], torch.Tensor | None]:
        """The tokens, sampling seeds and observations of rows [0, end), as the arena logged them."""
        observations = self.model.observations
        return (self.model.tokens[:end].tolist(), self.model.seeds[:end].tolist(),
                None if observations is None else observations[:end].clone())

    def _replay_start(self, state: Boundary, target: int) -> Boundary:
        """The nearest boundary at or before ``target``, loaded into the arena: a ring entry; else
        the capsule the state descends from, if the run passed its boundary (its rows are the
        live ones, so only its fixed block is copied); else the empty state."""
        index = next((i for i in range(len(state.ring) - 1, -1, -1) if state.ring[i].position <= target), None)
        if index is not None:
            return self._stepped_back(state, index)
        origin = None if state.base is None else self.capsules.kept(state.base.capsule)
        if origin is not None and 0 < origin.info.position <= min(target, state.base.rows):
            try:   # a disk capsule that can no longer be read is only a lost shortcut
                self.capsules.plan_restore(origin, keep_rows=origin.info.position).copy(self.arena.buffer)
                at = origin.info.position
                return moved(state, at, origin.log, self.ring_at(at), Base(origin.info.id, at), origin.info.id)
            except CapsuleError as exc:
                log.warning("rollback: capsule %s unreadable (%s); replaying from the empty state",
                            origin.info.id, exc)
        self.arena.buffer[:self.arena.fixed_bytes].zero_()
        return moved(state, 0, (), self.ring_at(0), None if state.base is None else Base(state.base.capsule, 0))

    def _replay(self, kind: str, start: int, count: int, tokens: list[int], seeds: list[int],
                observations: torch.Tensor | None) -> None:
        """Commit the logged rows [start, start + count) again, each with the sampling seed it
        was committed with (a prefill's rows share one): the RNG state ends as the run had it."""
        if kind == PREFILL:
            self.model.rng_seed.fill_(seeds[start])
            self.prefill(torch.tensor(tokens[start:start + count], device=self.arena.device))
            return
        for row in range(start, start + count):
            self.model.rng_seed.fill_(seeds[row])
            if kind == DECODE:
                self.logged_token(tokens[row])
            else:
                self.step(observations[row])
