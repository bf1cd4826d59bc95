"""One served engine: its calls as clients make them, journaled in commit order.

Every call takes the engine lock, makes its engine call and records the outcome (refusals too)
before the lock is let go, so the journal lists operations in the order the engine applied
them, however many clients call at once. Nothing here knows ROS; the node converts messages
and calls these methods, and an in-process user can do the same.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

from ..capsule import CapsuleInfo
from ..errors import ErrorCode, InvalidArgument
from ..runtime import Engine
from . import leases as lease_rules
from .journal import (DECODE, DROP, FORK, PREFILL, RESTORE, ROLLBACK, SNAPSHOT, SPILL, STEP, Journal,
                      action_bytes)
from .leases import Leases
from .requests import SnapshotRequests

log = logging.getLogger(__name__)

JOURNAL_TEXT = 1024   # longest string a request puts in the journal (valid ones are shorter)
_STATE_CALLS = (SNAPSHOT, FORK, RESTORE, ROLLBACK, DROP)   # the whole state is checked after these


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
    """``journal``: where committed operations are recorded (None: not recorded)."""

    def __init__(self, engine: Engine, journal: Journal | None = None) -> None:
        self.engine = engine
        self.journal = journal
        self.journal_failure = ""   # why the journal stopped, once it has
        self._requests = SnapshotRequests()
        self._leases = Leases()
        self._version = 0            # bumped by every state change: the status digest is cached per version
        self._digest: tuple[tuple[int, int], str] = ((-1, -1), "")

    # ---- capsule calls -------------------------------------------------------------------------
    def snapshot(self, name: str = "", tier: str = "device", pin: bool = False, request_id: str = "",
                 requested_tier: str | None = None, lease_s: float = 0.0) -> Made:
        """A capsule of the live state, in ``tier``. A repeat of an earlier ``request_id`` (with the
        same name, requested tier and pin) answers that request's capsule and changes nothing.
        ``lease_s`` > 0: the capsule is dropped once that long has passed since it was made or
        last named by a request (see ``leases``). ``requested_tier``: the tier as the client sent
        it, before a default filled it in (what a repeat is matched by)."""
        requested = tier if requested_tier is None else requested_tier
        fields = (name, requested, pin)

        def call(engine: Engine):
            lease = lease_rules.check(lease_s)
            capsule_id = self._requests.earlier(request_id, fields)
            if capsule_id is not None:
                info = engine.capsules.get(capsule_id, wait=False)
                self._leases.renew(info.id)
                return Made(info, repeat=True), None
            info = engine.snapshot(name=name or None, tier=tier, pin=pin)
            self._requests.remember(request_id, fields, info.id)
            self._leases.grant(info.id, lease)
            return Made(info), {"capsule_id": info.id}

        return self._run(SNAPSHOT, {"name": name, "tier": tier, "pin": pin, "request_id": request_id,
                                    "requested_tier": requested, "lease_s": lease_s}, call)

    def restore(self, capsule_id: str, verify: bool = False) -> CapsuleInfo:
        def call(engine: Engine):
            info = engine.restore(capsule_id, verify=verify)
            self._leases.renew(info.id)
            return info, {}

        return self._run(RESTORE, {"capsule_id": capsule_id, "verify": verify}, call)

    def fork(self, source_id: str = "", name: str = "", tier: str = "device", lease_s: float = 0.0) -> Made:
        """A fork of capsule ``source_id``, sharing its bytes in its tier; of the live state (a
        snapshot into ``tier``) when ``source_id`` is empty."""
        def call(engine: Engine):
            lease = lease_rules.check(lease_s)
            if source_id:
                info = engine.fork(source_id, name=name or None)
                self._leases.renew(info.parent)
            else:
                info = engine.snapshot(name=name or None, tier=tier)
            self._leases.grant(info.id, lease)
            return Made(info), {"capsule_id": info.id}

        return self._run(FORK, {"source_id": source_id, "name": name, "tier": "" if source_id else tier,
                                "lease_s": lease_s}, call)

    def rollback(self, steps: int = 1, to_position: int = -1) -> tuple[int, str]:
        """Back ``steps`` boundaries, or to ``to_position`` (-1: unused). Returns the position and,
        for ``to_position``, the capsule the replay started from ("" for none)."""
        def call(engine: Engine):
            if to_position < -1:
                raise InvalidArgument(f"to_position must be >= 0, or -1 for unused; got {to_position}")
            target = None if to_position == -1 else to_position
            position = engine.rollback(steps=steps, to_position=target)
            return (position, engine.rollback_origin if target is not None else ""), {}

        return self._run(ROLLBACK, {"steps": steps, "to_position": to_position}, call)

    def drop(self, capsule_id: str) -> CapsuleInfo:
        def call(engine: Engine):
            info = engine.capsules.drop(capsule_id)
            self._leases.forget(info.id)
            return info, {}

        return self._run(DROP, {"capsule_id": capsule_id}, call)

    def list(self, tier: str = "") -> list[CapsuleInfo]:
        return self.engine.capsules.list(tier)

    def expire(self) -> list[CapsuleInfo]:
        """Drop every capsule whose lease has run out (each journaled as a drop); returns them."""
        dropped = []
        with self.engine.lock:
            for capsule_id in self._leases.expired():
                try:
                    dropped.append(self.drop(capsule_id))
                except Exception as exc:   # dropped or evicted already, or its file cannot go
                    log.info("lease of capsule %s ended; not dropped: %s", capsule_id, exc)
        return dropped

    def set_spill(self, spill: bool) -> None:
        """Spill on or off at run time: it decides later refusals and evictions, so it is journaled."""
        def call(engine: Engine):
            engine.capsules.spill = bool(spill)
            return None, {}

        self._run(SPILL, {"spill": bool(spill)}, call)

    # ---- steps and generation ----------------------------------------------------------------
    def step(self, observation: torch.Tensor) -> torch.Tensor:
        """One policy step; a refused observation changes nothing and is not journaled."""
        with self.engine.lock:
            action = self.engine.step(observation)
            self._record(STEP, {"observation": observation.tolist()}, None, {"action": action_bytes(action)})
            self._version += 1
            return action

    def generate(self, ids: Sequence[int], n: int, temperature: float = 0.0, seed: int | None = None,
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
                self._record(PREFILL, {"token_ids": list(ids), "prompt": prompt}, None, {})
                self._version += 1
            stream = engine.stream(n, sync_every=1, temperature=temperature, seed=seed, scored=True,
                                   speculative=speculative)
        return self._tokens(stream, temperature, seed)

    def _tokens(self, stream: Iterator[tuple[int, float, int]], temperature: float,
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
                how: dict[str, Any] = {"temperature": temperature} if temperature > 0 else {}
                if seed is not None and first:
                    how["seed"] = seed
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
    def _run(self, kind: str, request: dict, call: Callable[[Engine], tuple[Any, dict | None]]) -> Any:
        """``call`` under the engine lock, journaled: its outcome fields, or the refusal it
        raised (re-raised). ``call`` returns (result, outcome fields), None for a repeat that
        changed nothing and is not journaled."""
        with self.engine.lock:
            try:
                result, extra = call(self.engine)
            except Exception as exc:
                self._record(kind, request, exc, {})
                raise
            if extra is not None:
                self._record(kind, request, None, extra)
                self._version += 1
            return result

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
                if kind in _STATE_CALLS:
                    out["state_digest"] = engine.state_digest()
            journal.record(kind, _capped(request), out)
        except Exception as failure:
            self.journal = None   # a journal with a gap would not replay: stop it here
            self.journal_failure = f"recording {kind} failed ({failure})"
            log.error("journal stopped: %s; serving goes on", self.journal_failure)
