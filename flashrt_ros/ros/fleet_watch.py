"""Whether the fleet tier's server answers, asked in the background: what /diagnostics and
~/events say of the connection.

A thread pings the server every ``period_s`` (each ping bounded by the tier's timeouts), so
that neither the status timer nor a service waits on a server that is down. A change of
reachability is kept for the node's tick to send as an event.
"""
from __future__ import annotations

import threading
from typing import Any

from ..errors import FlashRTError


class FleetWatch:
    """``reachable`` (None until the first answer), ``latency_s`` and ``error`` of the last ping;
    ``take_changes()`` the reachability changes since the last take, each (reachable, error)."""

    def __init__(self, fleet: Any, period_s: float = 2.0) -> None:
        self.fleet = fleet
        self.reachable: bool | None = None
        self.latency_s = 0.0
        self.error = ""
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
            with self._lock:
                reachable = not error
                if reachable != self.reachable:
                    self._changes.append((reachable, error))
                self.reachable, self.latency_s, self.error = reachable, latency, error
            self._stop.wait(period_s)

    def take_changes(self) -> list[tuple[bool, str]]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def close(self) -> None:
        """Stop pinging; a ping under way ends within the tier's timeouts (the thread is a daemon)."""
        self._stop.set()
