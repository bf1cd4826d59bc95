"""What each capsule service answers: the operation its request names, applied, into its response.

One function per service, all of one shape: ``answer(request, response, call)`` applies the
request and fills the fields particular to the service, returning the capsule involved (for the
event), a message ("" for "ok") and the position to answer (None: the state's). The fields every
service shares, and every refusal, are filled by the node.

A request with tier "fleet" names capsules of the fleet tier, and the capsules it makes go
there: Snapshot and Fork make a local capsule and publish it (a publish that fails drops it
again, so a failure leaves the local tiers as they were); Restore and Fork pull the capsule they
name first; List lists the fleet; Drop lets go of this node's reference on the fleet too. The
exchanges with the server run outside the engine lock (``Call.locked`` is taken only around the
engine's own operations), each bounded by ``Call.deadline_s``.
"""
from __future__ import annotations

import logging
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from ..capsule import CapsuleInfo
from ..capsule.errors import CapsuleError, UnknownCapsule
from ..errors import InvalidArgument, shown
from ..serving import Session
from ..serving.journal import DROP, FORK, RESTORE, ROLLBACK, SNAPSHOT
from ..serving.operations import Applied, Drop, requested
from ..srv import DropCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from .convert import info_msg

log = logging.getLogger(__name__)

LIST = "list"
FLEET = "fleet"
Answer = tuple[Optional[CapsuleInfo], str, Optional[int]]


@dataclass(frozen=True)
class Call:
    """What an answer works with. ``locked()``: the engine lock, with the node asked again
    under it whether it still serves ``session`` (NotActive if not). ``fleet``: the node's
    fleet tier (None: it has none); ``deadline_s``: what one exchange with it may take in all."""

    session: Session
    default_tier: str
    locked: Callable[[], AbstractContextManager]
    fleet: Any = None
    deadline_s: float | None = None
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float | None:
        """What is left of ``deadline_s`` for the next exchange of this request (a Fork pulls
        and publishes within one deadline)."""
        if self.deadline_s is None:
            return None
        return max(1e-3, self.deadline_s - (time.monotonic() - self.started))

    def the_fleet(self) -> Any:
        if self.fleet is None:
            raise InvalidArgument("tier 'fleet' asked of a node with no fleet tier (set its fleet.url parameter)")
        return self.fleet


def _apply(kind: str, request: Any, call: Call) -> Applied:
    with call.locked():
        return call.session.apply(requested(kind, request, call.default_tier))


def _with_capsule(response: Any, info: CapsuleInfo) -> CapsuleInfo:
    response.capsule_id = info.id
    response.capsule = info_msg(info)
    return info


def _published(response: Any, made: Applied, request: Any, lease_s: float, call: Call) -> CapsuleInfo:
    """The capsule ``made`` here, published to the fleet under the request's name with this
    node's reference for ``lease_s`` (0: until dropped); dropped here again if the publish
    fails (a repeat of a request_id keeps the capsule its first try made)."""
    fleet, info = call.the_fleet(), made.value
    try:
        published = fleet.publish(call.session.engine.capsules, info, name=request.name or None,
                                  ttl_s=lease_s or None, deadline_s=call.left())
    except Exception:
        response.capsule_id, response.capsule = "", info_msg(None)
        if not made.repeat:
            _unmake(info, getattr(request, "request_id", ""), call)
        raise
    return _with_capsule(response, published.info)


def _unmake(info: CapsuleInfo, request_id: str, call: Call) -> None:
    """Drop the capsule a failed publish made, and forget its request_id (a retry makes and
    publishes anew); journaled, so a replay forgets it too. What fails here is logged: the
    publish's failure is the answer."""
    try:
        with call.locked():
            call.session.apply(Drop(info.id, request_id=request_id))
    except Exception as exc:   # evicted meanwhile, or the node stopped serving: the lease or cleanup ends it
        log.warning("capsule %s of a failed publish not dropped: %s", info.id, exc)


def _pulled(ref: str, call: Call) -> str:
    """The id of the fleet capsule ``ref`` (an id, or a name on the fleet), pulled into the host
    tier, added and journaled while the node still serves."""
    return call.session.pull(ref, "host", deadline_s=call.left(), locked=call.locked).id


def snapshot(request: Any, response: Any, call: Call) -> Answer:
    op = requested(SNAPSHOT, request, call.default_tier)
    if request.tier == FLEET:   # made in the default tier; a repeat of its request_id matches "fleet"
        call.the_fleet().check_publish(request.name or None, op.lease_s or None)   # before a capsule is made
        op = replace(op, tier=call.default_tier)
    with call.locked():
        applied = call.session.apply(op)
    info, rid = _with_capsule(response, applied.value), request.request_id
    if request.tier == FLEET:
        info = _published(response, applied, request, op.lease_s, call)
    if applied.repeat:   # answered at the position the capsule was taken at
        return info, f"repeat of request_id {rid!r}: same capsule", info.position
    # The caller's trace id goes back in the answer and the event, and to the log.
    return info, f"ok (request_id {shown(rid)})" if rid else "", None


def restore(request: Any, response: Any, call: Call) -> Answer:
    op = requested(RESTORE, request, call.default_tier)
    if request.tier == FLEET:
        call.the_fleet()
        op = replace(op, capsule_id=_pulled(op.capsule_id, call))
    with call.locked():
        return _with_capsule(response, call.session.apply(op).value), "", None


def fork(request: Any, response: Any, call: Call) -> Answer:
    # A fork of the live state is a snapshot (see Engine.fork), into the tier a Snapshot with
    # no tier goes to; a fork of a capsule shares its bytes, in its tier.
    op = requested(FORK, request, call.default_tier)
    if request.tier == FLEET:
        call.the_fleet().check_publish(request.name or None, op.lease_s or None)
        if op.source_id:
            op = replace(op, source_id=_pulled(op.source_id, call))
    with call.locked():
        made = call.session.apply(op)
    info = made.value
    response.source_id = info.parent if op.source_id else ""   # an id, also when named
    if request.tier == FLEET:
        return _published(response, made, request, op.lease_s, call), "", None
    return _with_capsule(response, info), "", None


def rollback(request: Any, response: Any, call: Call) -> Answer:
    _, response.capsule_id = _apply(ROLLBACK, request, call).value
    return None, "", None


def listed(request: Any, response: Any, call: Call) -> Answer:
    if request.tier == FLEET:
        response.capsules = [info_msg(c.info) for c in call.the_fleet().list()]
    else:
        with call.locked():
            response.capsules = [info_msg(i) for i in call.session.list(request.tier)]
    return None, "", None


def drop(request: Any, response: Any, call: Call) -> Answer:
    """The capsule goes from this node's tiers, and this node's reference on it from the fleet
    when this run of the node took one, or when no local tier had it (a reference an earlier run
    took): UNKNOWN_CAPSULE only if neither had it. A local drop asks the server nothing else, and
    a local drop done stands when the fleet cannot be asked: the answer says so."""
    try:
        info = _apply(DROP, request, call).value
    except UnknownCapsule:
        if call.fleet is None:
            raise
        info = None
    response.capsule_id = info.id if info is not None else request.capsule_id
    if call.fleet is not None and (info is None or call.fleet.took_reference(info.id)):
        try:
            last = call.fleet.drop(response.capsule_id)
        except UnknownCapsule:
            if info is None:
                raise
        except CapsuleError as exc:
            if info is None:
                raise
            return info, f"ok here; this node's reference on the fleet, if any, is not dropped: {exc}", None
        else:
            return info, f"ok: this node's reference on the fleet dropped{' (the last one)' if last else ''}", None
    return info, "", None


# (service type, name under the node, kind, answer): the capsule services the node serves.
SERVICES: tuple[tuple[Any, str, str, Callable[..., Answer]], ...] = (
    (Snapshot, "snapshot", SNAPSHOT, snapshot), (Restore, "restore", RESTORE, restore), (Fork, "fork", FORK, fork),
    (Rollback, "rollback", ROLLBACK, rollback), (ListCapsules, "list_capsules", LIST, listed),
    (DropCapsule, "drop_capsule", DROP, drop))
