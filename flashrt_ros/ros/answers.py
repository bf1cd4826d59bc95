"""What each capsule service answers: the operation its request names, applied, into its response.

One function per service, all of one shape: ``answer(request, response, session, default_tier)``
applies the request and fills the fields particular to the service, returning the capsule
involved (for the event), a message ("" for "ok") and the position to answer (None: the
state's). The fields every service shares, and every refusal, are filled by the node.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from ..capsule import CapsuleInfo
from ..errors import shown
from ..serving import Session
from ..serving.journal import DROP, FORK, RESTORE, ROLLBACK, SNAPSHOT
from ..serving.operations import Applied, requested
from ..srv import DropCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from .convert import info_msg

LIST = "list"
Answer = tuple[Optional[CapsuleInfo], str, Optional[int]]


def _apply(kind: str, request: Any, session: Session, default_tier: str) -> Applied:
    return session.apply(requested(kind, request, default_tier))


def _with_capsule(response: Any, info: CapsuleInfo) -> CapsuleInfo:
    response.capsule_id = info.id
    response.capsule = info_msg(info)
    return info


def snapshot(request: Any, response: Any, session: Session, default_tier: str) -> Answer:
    applied = _apply(SNAPSHOT, request, session, default_tier)
    info, rid = _with_capsule(response, applied.value), request.request_id
    if applied.repeat:   # answered at the position the capsule was taken at
        return info, f"repeat of request_id {rid!r}: same capsule", info.position
    # The caller's trace id goes back in the answer and the event, and to the log.
    return info, f"ok (request_id {shown(rid)})" if rid else "", None


def restore(request: Any, response: Any, session: Session, default_tier: str) -> Answer:
    return _with_capsule(response, _apply(RESTORE, request, session, default_tier).value), "", None


def fork(request: Any, response: Any, session: Session, default_tier: str) -> Answer:
    # A fork of the live state is a snapshot (see Engine.fork), into the tier a Snapshot with
    # no tier goes to; a fork of a capsule shares its bytes, in its tier.
    info = _apply(FORK, request, session, default_tier).value
    response.source_id = info.parent if request.source_id else ""   # an id, also when named
    return _with_capsule(response, info), "", None


def rollback(request: Any, response: Any, session: Session, default_tier: str) -> Answer:
    _, response.capsule_id = _apply(ROLLBACK, request, session, default_tier).value
    return None, "", None


def listed(request: Any, response: Any, session: Session, default_tier: str) -> Answer:
    response.capsules = [info_msg(i) for i in session.list(request.tier)]
    return None, "", None


def drop(request: Any, response: Any, session: Session, default_tier: str) -> Answer:
    info = _apply(DROP, request, session, default_tier).value
    response.capsule_id = info.id
    return info, "", None


# (service type, name under the node, kind, answer): the capsule services the node serves.
SERVICES: tuple[tuple[Any, str, str, Callable[..., Answer]], ...] = (
    (Snapshot, "snapshot", SNAPSHOT, snapshot), (Restore, "restore", RESTORE, restore), (Fork, "fork", FORK, fork),
    (Rollback, "rollback", ROLLBACK, rollback), (ListCapsules, "list_capsules", LIST, listed),
    (DropCapsule, "drop_capsule", DROP, drop))
