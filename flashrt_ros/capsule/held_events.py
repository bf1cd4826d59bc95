"""The capsule store's lock, with the events raised under it delivered only as the outermost hold ends."""
from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from .info import CapsuleInfo


class Lockable(Protocol):
    """A reentrant lock: threading.RLock, or the engine's FairRLock."""

    def acquire(self) -> bool: ...

    def release(self) -> None: ...


class HeldEvents:
    """``with held:`` in place of ``with lock:``. A listener may call back into the store (drop
    a capsule on its spill event), and it must find every operation whole, never a capsule
    half-way down a tier: so ``events`` fills while the lock is held and empties at the end."""

    def __init__(self, lock: Lockable, deliver: Callable[[str, CapsuleInfo], None]) -> None:
        self._lock, self._deliver = lock, deliver
        self.depth = 0                    # changed only by the thread holding ``lock``
        self.events: deque[tuple[str, CapsuleInfo]] = deque()

    def __enter__(self) -> "HeldEvents":
        self._lock.acquire()   # not __enter__: one Python call fewer on every snapshot, from a cold cache
        self.depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        stopped: BaseException | None = None
        try:
            if self.depth == 1:   # a listener's own calls queue behind: delivered in order, here
                while self.events:
                    try:
                        self._deliver(*self.events.popleft())
                    except BaseException as raised:   # a Ctrl-C in a listener: the others still hear theirs
                        stopped = stopped or raised
        finally:
            self.depth -= 1
            self._lock.release()
        if stopped is not None:
            raise stopped
