"""The operations a client asks of a served engine: one frozen value per call, with its journal form.

``Rules.apply`` makes any of them on an engine, and holds once the rules that every caller
shares: a Snapshot repeating an answered ``request_id`` answers that capsule and changes
nothing; a Fork of no capsule is a snapshot of the live state into its tier; a capsule made
with a lease is dropped once it runs out. The session (serving), the in-process replay of a
journal, a journal rebuilt from a recording and the replay into a live node only build these
values or consume them. Adding an operation is a class here and its engine call in ``apply``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from ..capsule import CapsuleInfo
from ..errors import InvalidArgument
from ..runtime import GREEDY, Sampling, inputs
from . import leases as lease_rules
from .journal import DECODE, DROP, FORK, PREFILL, PULL, RESTORE, ROLLBACK, SNAPSHOT, SPILL, STEP, action_bytes
from .leases import Leases
from .requests import SnapshotRequests


@dataclass(frozen=True)
class Operation:
    """One call. ``KIND`` is its journal kind; ``journaled()`` its request as the journal holds it."""

    KIND: ClassVar[str] = ""

    def journaled(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def of(cls, request: Mapping[str, Any]) -> "Operation":
        """The operation a journal entry's request names (fields it lacks take their defaults)."""
        return cls(**{f.name: request[f.name] for f in fields(cls) if f.name in request})


@dataclass(frozen=True)
class Prefill(Operation):
    KIND: ClassVar[str] = PREFILL
    token_ids: Sequence[int] = ()
    prompt: str = ""

    def journaled(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids), "prompt": self.prompt}


@dataclass(frozen=True)
class Decode(Operation):
    """One token, chosen as ``sampling`` says (``seed`` set first, when given)."""

    KIND: ClassVar[str] = DECODE
    sampling: Sampling = GREEDY
    seed: int | None = None

    def journaled(self) -> dict[str, Any]:
        how: dict[str, Any] = {}
        if self.sampling.sampled:   # a greedy choice ignores the cut
            how["temperature"] = self.sampling.temperature
            if self.sampling.top_k:
                how["top_k"] = self.sampling.top_k
            if self.sampling.top_p < 1:
                how["top_p"] = self.sampling.top_p
        if self.seed is not None:
            how["seed"] = self.seed
        return how

    @classmethod
    def of(cls, request: Mapping[str, Any]) -> "Decode":
        how = inputs.sampling(request.get("temperature", 0.0), request.get("top_k", 0), request.get("top_p", 1.0))
        return cls(how, request.get("seed"))


@dataclass(frozen=True)
class Step(Operation):
    KIND: ClassVar[str] = STEP
    observation: Any = ()   # a vector: a tensor, or its values

    def journaled(self) -> dict[str, Any]:
        obs = self.observation
        return {"observation": obs.tolist() if isinstance(obs, torch.Tensor) else np.asarray(obs).tolist()}


@dataclass(frozen=True)
class Snapshot(Operation):
    """``tier``: where the capsule goes (a default filled in); ``requested_tier``: the tier as the
    client sent it, what a repeat of ``request_id`` is matched by."""

    KIND: ClassVar[str] = SNAPSHOT
    name: str = ""
    tier: str = "device"
    pin: bool = False
    request_id: str = ""
    requested_tier: str | None = None
    lease_s: float = 0.0

    @property
    def matched(self) -> tuple:
        """What a repeat of its request_id must ask again."""
        return (self.name, self.tier if self.requested_tier is None else self.requested_tier, bool(self.pin))

    def journaled(self) -> dict[str, Any]:
        return {"name": self.name, "tier": self.tier, "pin": self.pin, "request_id": self.request_id,
                "requested_tier": self.matched[1], "lease_s": self.lease_s}


@dataclass(frozen=True)
class Restore(Operation):
    KIND: ClassVar[str] = RESTORE
    capsule_id: str = ""
    verify: bool = False


@dataclass(frozen=True)
class Fork(Operation):
    """A fork of capsule ``source_id``, sharing its bytes in its tier; of the live state (a
    snapshot into ``tier``) when ``source_id`` is empty."""

    KIND: ClassVar[str] = FORK
    source_id: str = ""
    name: str = ""
    tier: str = "device"
    lease_s: float = 0.0

    def journaled(self) -> dict[str, Any]:
        return {"source_id": self.source_id, "name": self.name, "tier": "" if self.source_id else self.tier,
                "lease_s": self.lease_s}

    @classmethod
    def of(cls, request: Mapping[str, Any]) -> "Fork":
        # Journals before the tier was recorded forked the live state into the device tier.
        return cls(request.get("source_id", ""), request.get("name", ""), request.get("tier") or "device",
                   request.get("lease_s", 0.0))


@dataclass(frozen=True)
class Rollback(Operation):
    """Back ``steps`` boundaries, or to ``to_position`` (-1: unused)."""

    KIND: ClassVar[str] = ROLLBACK
    steps: int = 1
    to_position: int = -1


@dataclass(frozen=True)
class Drop(Operation):
    """``request_id``: the snapshot request that made the capsule is forgotten too, so that its
    retry makes one anew (the capsule of a publish that failed)."""

    KIND: ClassVar[str] = DROP
    capsule_id: str = ""
    request_id: str = ""


@dataclass(frozen=True)
class Spill(Operation):
    """Spill on or off at run time: it decides later refusals and evictions."""

    KIND: ClassVar[str] = SPILL
    spill: bool = True


@dataclass(frozen=True)
class Pull(Operation):
    """The fleet capsule ``capsule_id`` added to the local ``tier`` (``name``: the fleet name it
    was asked by, "" for its id). Journaled by id: a name may point elsewhere by replay time."""

    KIND: ClassVar[str] = PULL
    capsule_id: str = ""
    name: str = ""
    tier: str = "host"


OPERATIONS: dict[str, type[Operation]] = {op.KIND: op for op in
                                          (Prefill, Decode, Step, Snapshot, Restore, Fork, Rollback, Drop, Spill,
                                           Pull)}
CAPSULE_KINDS = (SNAPSHOT, FORK, RESTORE, ROLLBACK, DROP)   # the whole state is checked after these


def operation_of(kind: str, request: Mapping[str, Any]) -> Operation:
    """The operation of a journal entry; InvalidArgument for a kind no operation has."""
    if kind not in OPERATIONS:
        raise InvalidArgument(f"no operation is journaled as {kind!r}")
    return OPERATIONS[kind].of(request)


def requested(kind: str, request: Any, default_tier: str) -> Operation:
    """The operation a capsule service's request asks for: the node's request message, or one a
    bag recorded (read by field name). ``default_tier``: where a snapshot or a fork of the
    live state that names no tier goes."""
    if kind == SNAPSHOT:
        return Snapshot(request.name, request.tier or default_tier, bool(request.pin), request.request_id,
                        request.tier, float(request.lease_s))
    if kind == FORK:
        return Fork(request.source_id, request.name, default_tier, float(request.lease_s))
    if kind == RESTORE:
        return Restore(request.capsule_id, bool(request.verify))
    if kind == ROLLBACK:
        return Rollback(int(request.steps), int(request.to_position))
    if kind == DROP:
        return Drop(request.capsule_id)
    raise InvalidArgument(f"no capsule service asks for {kind!r}")


class Applied(NamedTuple):
    """What an operation gave: the caller's answer (a CapsuleInfo, a token, an action, a position)
    and its journal outputs; ``repeat``: an earlier request's answer, nothing changed."""

    value: Any
    outputs: dict[str, Any]
    repeat: bool = False


class Rules:
    """Applies operations to one engine with the rules they share (see the module docstring).
    ``ids``: capsule ids as the operations name them -> this engine's (a replay's map).
    ``fleet``: the fleet tier (``capsule.fleet.FleetTier``) a Pull takes its capsule from."""

    def __init__(self, ids: dict[str, str] | None = None, fleet: Any = None) -> None:
        self.requests = SnapshotRequests()
        self.leases = Leases()
        self.ids = ids if ids is not None else {}
        self.fleet = fleet

    def _id(self, capsule_id: str) -> str:
        return self.ids.get(capsule_id, capsule_id)

    def apply(self, op: Operation, engine: Any) -> Applied:
        """Make ``op`` on ``engine`` (the caller holds its lock); FlashRTError when refused."""
        if isinstance(op, Prefill):
            engine.prefill(op.token_ids)
            return Applied(None, {})
        if isinstance(op, Decode):
            token = engine.generate(1, **op.sampling.as_kwargs(), seed=op.seed)[0]
            return Applied(token, {"token": token})
        if isinstance(op, Step):
            action = engine.step(op.observation)
            return Applied(action, {"action": action_bytes(action)})
        if isinstance(op, Snapshot):
            return self._snapshot(op, engine)
        if isinstance(op, Fork):
            lease = lease_rules.check(op.lease_s)
            if op.source_id:
                info = engine.fork(self._id(op.source_id), name=op.name or None)
                self.leases.renew(info.parent)
            else:
                info = engine.snapshot(name=op.name or None, tier=op.tier)
            self.leases.grant(info.id, lease)
            return Applied(info, {"capsule_id": info.id})
        if isinstance(op, Restore):
            info = engine.restore(self._id(op.capsule_id), verify=bool(op.verify))
            self.leases.renew(info.id)
            return Applied(info, {})
        if isinstance(op, Rollback):
            if op.to_position < -1:
                raise InvalidArgument(f"to_position must be >= 0, or -1 for unused; got {op.to_position}")
            target = None if op.to_position == -1 else op.to_position
            position = engine.rollback(steps=op.steps, to_position=target)
            return Applied((position, engine.rollback_origin if target is not None else ""), {})
        if isinstance(op, Drop):
            info = engine.capsules.drop(self._id(op.capsule_id))
            self.leases.forget(info.id)
            self.requests.forget(op.request_id)
            return Applied(info, {})
        if isinstance(op, Spill):
            engine.capsules.spill = bool(op.spill)
            return Applied(None, {})
        if isinstance(op, Pull):
            return self.pull(op, engine)
        raise InvalidArgument(f"not an operation: {op!r}")

    def pull(self, op: Pull, engine: Any, deadline_s: float | None = None) -> Applied:
        """``op``: its capsule from the fleet tier into the engine's store (no engine lock needed:
        the store takes its own, and the live state is not touched)."""
        if self.fleet is None:
            raise InvalidArgument(f"capsule {op.capsule_id} comes from the fleet tier, and there is none here "
                                  "(a node: set fleet.url; a replay: give it the fleet)")
        info = self.fleet.pull(engine.capsules, op.capsule_id, op.tier, name=op.name, deadline_s=deadline_s)
        return Applied(info, {"capsule_id": info.id})

    def _snapshot(self, op: Snapshot, engine: Any) -> Applied:
        lease = lease_rules.check(op.lease_s)
        earlier = self.requests.earlier(op.request_id, op.matched)
        if earlier is not None:
            # Its capsule may have gone since (dropped, evicted): then the lookup refuses.
            info: CapsuleInfo = engine.capsules.get(earlier, wait=False)
            self.leases.renew(info.id)
            return Applied(info, {"capsule_id": info.id}, repeat=True)
        info = engine.snapshot(name=op.name or None, tier=op.tier, pin=bool(op.pin))
        self.requests.remember(op.request_id, op.matched, info.id)
        self.leases.grant(info.id, lease)
        return Applied(info, {"capsule_id": info.id})
