"""One served engine: its calls as clients make them, journaled in commit order.

Every call takes the engine lock, makes its engine call and records the outcome (refusals too)
before the lock is let go, so the journal lists operations in the order the engine applied
them, however many clients call at once. Nothing here knows ROS; the node converts messages
and calls these methods, and an in-process user can do the same.
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from ..capsule import CapsuleInfo
from ..errors import ErrorCode, InvalidArgument
from ..runtime import GREEDY, Engine, Sampling
from .journal import DECODE, PREFILL, STEP, Journal, action_bytes
from .operations import (CAPSULE_KINDS, Applied, Decode, Drop, Fork, Operation, Prefill, Pull, Restore, Rollback,
                         Rules, Snapshot, Spill, Step)

log = logging.getLogger(__name__)

JOURNAL_TEXT = 1024   # longest string a request puts in the journal (valid ones are shorter)


class Made(NamedTuple):
    """A capsule a snapshot or fork request made, and whether it is an earlier request's answer."""

    info: CapsuleInfo
    repeat: bool = False


def _capped(request: dict) -> dict:
    """A request as journaled: a string past any valid length (a name is at most 128, a
    request_id 256 characters) is cut, so a megabyte field cannot bloat the bag. Cut, it is
    just as invalid: replay reproduces the same refusal."""
    return {k: v[:JOURNAL_TEXT] if isinstance(v, str) and len(v) > JOURNAL_TEXT else v for k, v in request.items()}


class Session:
    """``journal``: where committed operations are recorded (None: not recorded). ``fleet``: the
    fleet tier (``capsule.fleet.FleetTier``) that ``pull`` takes capsules from, if any."""

    def __init__(self, engine: Engine, journal: Journal | None = None, fleet: Any = None) -> None:
        self.engine = engine
        self.journal = journal
        self.journal_failure = ""   # why the journal stopped, once it has
        self.rules = Rules(fleet=fleet)
        self._version = 0            # bumped by every state change: the status digest is cached per version
        self._digest: tuple[tuple[int, int], str] = ((-1, -1), "")

    def apply(self, op: Operation) -> Applied:
        """``op`` under the engine lock, journaled with its outcome, or with the refusal it raised
        (re-raised). A repeat that changed nothing is not journaled."""
        with self.engine.lock:
            try:
                applied = self.rules.apply(op, self.engine)
            except Exception as exc:
                self._record(op.KIND, op.journaled(), exc, {})
                raise
            if not applied.repeat:
                self._record(op.KIND, op.journaled(), None, applied.outputs)
                self._version += 1
            return applied

    # ---- capsule calls, by their fields --------------------------------------------------------
    def snapshot(self, name: str = "", tier: str = "device", pin: bool = False, request_id: str = "",
                 requested_tier: str | None = None, lease_s: float = 0.0) -> Made:
        """``apply(Snapshot(...))``: a capsule of the live state (see ``operations.Snapshot``)."""
        applied = self.apply(Snapshot(name, tier, pin, request_id, requested_tier, lease_s))
        return Made(applied.value, applied.repeat)

    def restore(self, capsule_id: str, verify: bool = False) -> CapsuleInfo:
        return self.apply(Restore(capsule_id, verify)).value

    def fork(self, source_id: str = "", name: str = "", tier: str = "device", lease_s: float = 0.0) -> Made:
        return Made(self.apply(Fork(source_id, name, tier, lease_s)).value)

    def rollback(self, steps: int = 1, to_position: int = -1) -> tuple[int, str]:
        """(the position, and for ``to_position`` the capsule the replay started from, "" for none)."""
        return self.apply(Rollback(steps, to_position)).value

    def drop(self, capsule_id: str) -> CapsuleInfo:
        return self.apply(Drop(capsule_id)).value

    def pull(self, ref: str, tier: str = "host", deadline_s: float | None = None,
             locked: Callable[[], AbstractContextManager] | None = None) -> CapsuleInfo:
        """The fleet capsule ``ref`` (an id, or a name on the fleet) in the local ``tier``, to
        restore or fork like any other. One held here already is returned as it is, nothing
        journaled. Else the transfer and its checks hold no lock (steps and tokens go on), and
        the capsule is added and journaled (``pull``, by id) under ``locked()`` (default: the
        engine lock; a node passes the lock that also asks whether it still serves). A refused
        pull changes nothing and is not journaled: the fleet's faults are not the engine's,
        and no replay reproduces them."""
        fleet = self.rules.fleet
        if fleet is None:
            raise InvalidArgument("no fleet tier: this session was given none")
        store = self.engine.capsules
        capsule_id = fleet.resolve(ref)
        held = fleet.local(store, capsule_id)
        if held is not None:
            return held
        fetched = fleet.fetch(store, capsule_id, tier, deadline_s=deadline_s)
        with (locked or (lambda: self.engine.lock))():
            info = fleet.adopt(store, fetched, tier, ref if ref != capsule_id else "")
            self._record(Pull.KIND, Pull(info.id, info.name, info.tier).journaled(), None, {"capsule_id": info.id})
        return info

    def list(self, tier: str = "") -> list[CapsuleInfo]:
        return self.engine.capsules.list(tier)

    def expire(self) -> list[CapsuleInfo]:
        """Drop every capsule whose lease has run out (each journaled as a drop); returns them."""
        dropped = []
        with self.engine.lock:
            for capsule_id in self.rules.leases.expired():
                try:
                    dropped.append(self.drop(capsule_id))
                except Exception as exc:   # dropped or evicted already, or its file cannot go
                    log.info("lease of capsule %s ended; not dropped: %s", capsule_id, exc)
        return dropped

    def set_spill(self, spill: bool) -> None:
        self.apply(Spill(bool(spill)))

    # ---- steps and generation ----------------------------------------------------------------
    def step(self, observation: torch.Tensor) -> torch.Tensor:
        """One policy step; a refused observation changes nothing and is not journaled."""
        with self.engine.lock:
            action = self.engine.step(observation)
            self._record(STEP, Step(observation).journaled(), None, {"action": action_bytes(action)})
            self._version += 1
            return action

    def generate(self, ids: Sequence[int], n: int, sampling: Sampling = GREEDY, seed: int | None = None,
                 prompt: str = "", speculative: int | None = None) -> Iterator[int]:
        """Commit the prompt ``ids`` now, then return the next ``n`` tokens as an iterator that
        commits one per step (or several per speculative pass, ``Engine.stream``). The iterator
        raises Preempted (the tokens before it stay) once a restore, rollback or reset replaces
        the state it extends; stopping early is dropping it."""
        engine = self.engine
        engine.check_speculative(speculative)   # refused before the prompt is committed
        with engine.lock:
            if ids:
                engine.prefill(ids)
                self._record(PREFILL, Prefill(ids, prompt).journaled(), None, {})
                self._version += 1
            stream = engine.stream(n, sync_every=1, **sampling.as_kwargs(), seed=seed, scored=True,
                                   speculative=speculative)
        return self._tokens(stream, sampling, seed)

    def _tokens(self, stream: Iterator[tuple[int, float, int]], sampling: Sampling,
                seed: int | None) -> Iterator[int]:
        first = True
        while True:
            with self.engine.lock:   # the token and its entry in one hold: nothing lands between them
                scored = next(stream, None)
                if scored is None:
                    return
                token, margin, position = scored
                # How it was drawn. Not whether speculatively: such a token replays as a plain
                # decode step, which commits the same bytes on the CPU backend (``Engine.stream``).
                how = Decode(sampling, seed if first else None).journaled()
                self._record(DECODE, how, None, {"token": token, "margin": margin}, position=position)
                self._version += 1
            first = False
            yield token

    def status_digest(self) -> str:
        """The live state's digest, computed once per state (the version of the last change)."""
        with self.engine.lock:
            key = (self._version, self.engine.position)
            if self._digest[0] != key:
                self._digest = (key, self.engine.state_digest())
            return self._digest[1]

    # ---- internals -----------------------------------------------------------------------------
    def _record(self, kind: str, request: dict, exc: BaseException | None, extra: dict,
                position: int | None = None) -> None:
        """Journal one operation. It has happened (or been refused) already, so a journal that
        cannot write stops recording and changes no answer. ``position``: the one it left, where
        the engine has moved on since (the earlier tokens of a speculative pass)."""
        journal = self.journal
        if journal is None:
            return
        try:
            engine = self.engine
            out = {"error_code": int(getattr(exc, "code", ErrorCode.INTERNAL)) if exc else 0,
                   "position": engine.position if position is None else position}
            if exc is None:
                out.update(extra)
                if kind in CAPSULE_KINDS:
                    out["state_digest"] = engine.state_digest()
            journal.record(kind, _capped(request), out)
        except Exception as failure:
            self.journal = None   # a journal with a gap would not replay: stop it here
            self.journal_failure = f"recording {kind} failed ({failure})"
            log.error("journal stopped: %s; serving goes on", self.journal_failure)
