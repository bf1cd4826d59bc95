"""Leases on capsules a client made: a capsule made with one is the server's to drop once the
lease has run out since it was made or last named by a request (a restore or a fork of it, a
repeat of its snapshot's request id). A client that abandons an attempt (a timeout, a halt)
then leaves nothing behind, and keeps no list of what its abandoned attempts made."""
from __future__ import annotations

import math
import time
from typing import Callable

from ..errors import InvalidArgument

MAX_LEASE_S = 7 * 24 * 3600.0


def check(seconds: float) -> float:
    """A lease in seconds: 0 (none: the capsule stays until dropped) up to a week."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds) \
            or not 0.0 <= seconds <= MAX_LEASE_S:
        raise InvalidArgument(f"lease_s must be a number of seconds in [0, {MAX_LEASE_S:g}] (0: no lease), "
                              f"got {seconds!r}")
    return float(seconds)


class Leases:
    """capsule id -> (lease seconds, when it runs out), on ``clock`` (monotonic seconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[str, tuple[float, float]] = {}

    def grant(self, capsule_id: str, seconds: float) -> None:
        if seconds > 0:
            self._held[capsule_id] = (seconds, self._clock() + seconds)

    def renew(self, capsule_id: str) -> None:
        held = self._held.get(capsule_id)
        if held is not None:
            self._held[capsule_id] = (held[0], self._clock() + held[0])

    def forget(self, capsule_id: str) -> None:
        self._held.pop(capsule_id, None)

    def expired(self) -> list[str]:
        """The capsules whose lease has run out, oldest first (forgotten here)."""
        now = self._clock()
        out = sorted((end, cid) for cid, (_, end) in self._held.items() if end <= now)
        for _, cid in out:
            del self._held[cid]
        return [cid for _, cid in out]

    def clear(self) -> None:
        self._held.clear()
