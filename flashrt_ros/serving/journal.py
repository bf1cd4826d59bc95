"""A session as data: every state-changing operation in the order the engine applied it.

The session layer records an entry while it still holds the engine lock, so the order of entries
is the order of committed boundaries, even when many clients call at once. Replay
(``flashrt_ros.replay``) applies them to a fresh engine and compares every output.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from .record import SessionRecord

# Kinds of entries, and the engine call each one replays as. SPILL is the spill
# parameter changed at run time: it decides later refusals and evictions. PULL is a capsule of the
# fleet tier added to a local tier: a later restore or fork may name it, so a replay pulls it again.
PREFILL, DECODE, STEP = "prefill", "decode", "step"
SNAPSHOT, FORK, RESTORE, ROLLBACK, DROP = "snapshot", "fork", "restore", "rollback", "drop"
SPILL, PULL = "spill", "pull"
KINDS = (PREFILL, DECODE, STEP, SNAPSHOT, FORK, RESTORE, ROLLBACK, DROP, SPILL, PULL)


@dataclass(frozen=True)
class Entry:
    seq: int
    kind: str
    request: dict[str, Any]
    outcome: dict[str, Any]   # success, error_code, position, and the kind's outputs


def action_bytes(action: Any) -> str:
    """An action vector (a torch tensor) as the hex of its float32 bytes, compared byte for byte on replay.

    Duck-typed so that readers of a journal (the demo's client) need not import torch.
    """
    return action.detach().cpu().float().numpy().astype("<f4").tobytes().hex()


@dataclass
class Journal:
    """Thread-safe, append-only; ``listeners`` see each entry as it is recorded.

    ``session`` describes the engine the entries ran on (see ``session_of``), so
    that a replay can build the same one.
    """

    session: SessionRecord = field(default_factory=SessionRecord)
    entries: list[Entry] = field(default_factory=list)
    listeners: list[Callable[[Entry], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, request: dict[str, Any], outcome: dict[str, Any]) -> Entry:
        if kind not in KINDS:
            raise ValueError(f"unknown journal entry kind {kind!r}")
        with self._lock:
            entry = Entry(len(self.entries), kind, dict(request), dict(outcome))
            self.entries.append(entry)
        for listener in self.listeners:
            listener(entry)
        return entry
