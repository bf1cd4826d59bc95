"""A reentrant lock that serves waiting threads in arrival order.

The engine takes its lock once per decode step. ``threading.RLock`` makes no
promise about who gets it next, and the generating thread, which releases and
takes it again within a few bytecodes, can win it back again and again, so a
snapshot that arrives mid-generation could wait for many decode steps. With
arrival order, it waits for at most the step in progress.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from threading import get_ident


class FairRLock:
    """Reentrant; a released lock goes to the longest-waiting thread."""

    __slots__ = ("_guard", "_cond", "_owner", "_depth", "_queue")

    def __init__(self) -> None:
        # The fast paths take ``_guard`` itself, the condition's lock: Condition.__enter__ is a
        # Python call, one more on every snapshot's and restore's path.
        self._guard = threading.Lock()
        self._cond = threading.Condition(self._guard)
        self._owner: int | None = None
        self._depth = 0
        self._queue: deque[int] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = get_ident()
        if self._owner == me:
            # Only the owner sets the owner to itself or changes the depth, so re-entry needs
            # no internal lock (a capsule call re-enters two or three times).
            self._depth += 1
            return True
        with self._guard:
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            self._queue.append(me)
            deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
            try:
                while self._owner is not None or self._queue[0] != me:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._leave_queue(me)
                        return False
                    self._cond.wait(left)
            except BaseException:   # a Ctrl-C in the wait: a place left in the queue would block all
                self._leave_queue(me)
                raise
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def _leave_queue(self, me: int) -> None:
        """Called with ``_cond`` held."""
        self._queue.remove(me)
        self._cond.notify_all()  # the thread behind us may now be first

    def release(self, *_exc: object) -> None:
        """Also the lock's ``__exit__``, whose exception arguments it ignores."""
        if self._owner != get_ident():
            raise RuntimeError("cannot release a FairRLock this thread does not hold")
        if self._depth > 1:   # an inner release: the lock stays ours (see acquire)
            self._depth -= 1
            return
        with self._guard:
            self._depth = 0
            self._owner = None
            if self._queue:
                self._cond.notify_all()

    def held_by_me(self) -> bool:
        return self._owner == get_ident()

    # Aliases, not wrappers: one Python call fewer on every capsule call's path. As with
    # threading.Lock, ``with lock as x`` binds what acquire returns.
    __enter__ = acquire
    __exit__ = release
