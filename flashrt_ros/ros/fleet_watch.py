"""Whether the fleet tier's server answers, asked in the background: what /diagnostics and
~/events say of the connection.

A thread pings the server every ``period_s`` (each ping bounded by the tier's timeouts), so
that neither the status timer nor a service waits on a server that is down. A change of
reachability is kept for the node's tick to send as an event.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, NamedTuple

from ..errors import FlashRTError

log = logging.getLogger(__name__)


class Seen(NamedTuple):
    """The last ping: ``reachable`` (None before the first answer), its round trip, and why not."""

    reachable: bool | None
    latency_s: float
    error: str


class FleetWatch:
    """``seen()``: the last ping; ``take_changes()`` the reachability changes since the last
    take, each (reachable, error)."""

    def __init__(self, fleet: Any, period_s: float = 2.0) -> None:
        self.fleet = fleet
        self._seen = Seen(None, 0.0, "")
        self._changes: list[tuple[bool, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="fleet-watch", daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.is_set():
            try:
                latency, error = self.fleet.ping(), ""
            except FlashRTError as exc:
                latency, error = 0.0, str(exc)
            except Exception as exc:   # a fault of the client itself: said, and the watch goes on
                log.exception("fleet tier: ping failed")
                latency, error = 0.0, f"{type(exc).__name__}: {exc}"
            with self._lock:
                reachable = not error
                if reachable != self._seen.reachable:
                    self._changes.append((reachable, error))
                self._seen = Seen(reachable, latency, error)
            self._stop.wait(period_s)

    def seen(self) -> Seen:
        with self._lock:
            return self._seen

    def take_changes(self) -> list[tuple[bool, str]]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def close(self, wait_s: float = 5.0) -> None:
        """Stop pinging, and wait for a ping under way (bounded by the tier's timeouts) up to
        ``wait_s``, so that the tier's connections close after it."""
        self._stop.set()
        self._thread.join(wait_s)
