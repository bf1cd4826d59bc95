"""Snapshot's request_id: one id names one snapshot, so a retried request never snapshots twice.

A behaviour tree that times out waiting for a Snapshot answer retries with the
same request_id; the node then answers with the capsule the first request made.
The rule lives in the session layer, under ROS, so that replay applies it to a journal
exactly as the node did.
"""
from __future__ import annotations

from collections import OrderedDict

from ..errors import InvalidArgument, shown

MAX_LENGTH = 256
REMEMBERED = 1024   # the oldest ids are forgotten first


class SnapshotRequests:
    """request_id -> (the request's own fields, the capsule id it made)."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._seen: OrderedDict[str, tuple[tuple, str]] = OrderedDict()
        self._remembered = remembered

    def earlier(self, request_id: str, fields: tuple) -> str | None:
        """The capsule an identical earlier request made; None for an empty or new id.

        InvalidArgument for an id past MAX_LENGTH, or one used before with other fields.
        ``fields`` are the request as sent (a tier left empty stays empty), so that a
        retry matches its first try whatever the defaults have become since.
        """
        if len(request_id) > MAX_LENGTH:
            raise InvalidArgument(f"request_id is {len(request_id)} characters; at most {MAX_LENGTH}")
        if not request_id or request_id not in self._seen:
            return None
        before, capsule_id = self._seen[request_id]
        if before != fields:
            # Cut: a retry's fields are not checked yet, and one may be megabytes long.
            raise InvalidArgument(f"request_id {request_id!r} was used with (name, tier, pin) = "
                                  f"{', '.join(map(shown, before))}, now {', '.join(map(shown, fields))}: "
                                  f"a request_id names one snapshot")
        return capsule_id

    def remember(self, request_id: str, fields: tuple, capsule_id: str) -> None:
        if request_id:
            self._seen[request_id] = (fields, capsule_id)
            while len(self._seen) > self._remembered:
                self._seen.popitem(last=False)

    def forget(self, request_id: str) -> None:
        """A request_id whose capsule was unmade: its retry is a new request."""
        self._seen.pop(request_id, None)

    def clear(self) -> None:
        self._seen.clear()
