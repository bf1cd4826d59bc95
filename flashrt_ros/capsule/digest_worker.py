"""Capsule digests hashed off the snapshot path, by a worker that posts what it computed.

The worker knows nothing of the store. It is handed jobs, each the pieces of one capsule
at a position; it hashes those bytes (``hashed``: a pure function of them), lets go of the
pieces, and posts (job, hashes). The store takes what was posted (``take_posted``) under its
own lock, and only then does a digest reach a capsule: so a record changes under the store's
lock alone. A job that carries a fleet chunking also names the capsule's chunks as the fleet
tier cuts it, in the same pass over its bytes, so that a publish sends at once.

``submit`` does not wake the worker. A woken worker at once competes for the interpreter
lock with the thread that just took the snapshot, in the middle of its latency-critical call
and the caller's next ones. The owner wakes it (``wake``) as it starts a long step; an idle
owner's queue is picked up by the worker's own poll (every ``POLL_S``).

A job is queued, running (the worker has it), or posted. An owner that needs a job's result
now (``result``) hashes it in its own thread if it is queued, or waits while the worker runs
it (one hash at most); one that forgets a job (``cancel``) takes it back from the queue, or
waits likewise, so that the worker reads no bytes after the owner has let them go. The
worker never waits for the owner's lock, so the owner may wait holding it.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import NamedTuple, Sequence

from ..digest import history_digest, state_digest
from .fleet_chunks import Chunking, chunk_digests
from .layout import Layout
from .pieces import Piece, read_pieces

log = logging.getLogger(__name__)

POLL_S = 1.0   # an idle worker looks at its queue once a second: a bound on a digest's delay


class DigestJob:
    """The bytes of capsule ``capsule_id`` to hash: ``pieces``, a capsule at ``position``;
    with ``chunking``, its fleet chunks' names too."""

    __slots__ = ("capsule_id", "position", "pieces", "chunking")

    def __init__(self, capsule_id: str, position: int, pieces: Sequence[Piece],
                 chunking: Chunking | None = None) -> None:
        self.capsule_id, self.position, self.pieces, self.chunking = capsule_id, position, pieces, chunking


class Hashes(NamedTuple):
    """What a job's bytes hash to: the capsule digest and history hash ("" both if they could
    not be read), and the names of its fleet chunks (``chunking`` None: none asked)."""

    digest: str
    history: str
    chunking: Chunking | None = None
    chunks: tuple[str, ...] = ()


FAILED = Hashes("", "")


def hashed(layout: Layout, job: DigestJob) -> Hashes:
    """The job's hashes; ``FAILED`` if its bytes cannot be read, which leaves the capsule
    without a digest rather than the caller without an answer."""
    read = lambda start, end: read_pieces(job.pieces, start, end)  # noqa: E731
    try:
        history = history_digest(layout.regions, job.position, read)
        if job.chunking is None:
            return Hashes(state_digest(layout.ranges(job.position), read), history)
        digest, chunks = chunk_digests(layout, job.position, job.chunking, read)
        return Hashes(digest, history, job.chunking, chunks)
    except Exception:
        log.exception("digest of capsule %s failed", job.capsule_id)
        return FAILED


class DigestWorker:
    """One thread hashing the jobs submitted, in order. It holds no reference to its owner:
    it holds only the queued jobs and the one it runs, and ``stop`` lets go of them."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[DigestJob] = deque()
        self._running: DigestJob | None = None
        self._posted: deque[tuple[DigestJob, Hashes]] = deque()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="capsule-digest", daemon=True)
        self._thread.start()

    @property
    def posted(self) -> bool:
        """Whether results wait to be taken (read without the lock: a deque's length is atomic)."""
        return bool(self._posted)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: DigestJob) -> None:
        """Queue ``job`` for the next ``wake`` or poll. No lock: a deque's append is atomic,
        and the worker takes a job (and the owner takes one back) only under the lock."""
        self._queue.append(job)

    def wake(self) -> None:
        """Start on the queued jobs now (nothing to do when none is queued)."""
        if self._queue:
            with self._cond:
                self._cond.notify()

    def result(self, job: DigestJob) -> Hashes:
        """The hashes of a job not taken yet, now: hashed in this thread if the worker has not
        started it, else its posted result; ``FAILED`` if the worker was stopped before it."""
        with self._cond:
            if not self._unqueue(job):
                self._cond.wait_for(lambda: self._running is not job)
                for i, (posted, hashes) in enumerate(self._posted):
                    if posted is job:
                        del self._posted[i]
                        return hashes
                return FAILED
        return hashed(self._layout, job)

    def cancel(self, job: DigestJob) -> None:
        """Forget ``job``: once this returns, the worker reads none of its bytes. Its result,
        if one is posted, is the owner's to ignore."""
        with self._cond:
            if not self._unqueue(job):
                self._cond.wait_for(lambda: self._running is not job)

    def _unqueue(self, job: DigestJob) -> bool:
        try:
            self._queue.remove(job)
        except ValueError:
            return False
        return True

    def take_posted(self) -> list[tuple[DigestJob, Hashes]]:
        """The results posted since the last take, in the order they were computed."""
        with self._cond:
            posted = list(self._posted)
            self._posted.clear()
        return posted

    def stop(self) -> None:
        """Forget the queued and posted jobs; the thread ends after the job it runs, which it
        does not post. Jobs submitted afterwards stay queued for the owner to take back."""
        with self._cond:
            self._stopped = True
            self._queue.clear()
            self._posted.clear()
            self._cond.notify_all()

    def close(self) -> None:
        """``stop``, and return once the thread has ended."""
        self.stop()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._queue or self._stopped, timeout=POLL_S):
                    continue
                if self._stopped:
                    return
                job = self._running = self._queue.popleft()
            result = hashed(self._layout, job)
            job.pieces = ()   # the bytes are the owner's again; a posted result holds none of them
            with self._cond:
                self._running = None
                if not self._stopped:
                    self._posted.append((job, result))
                self._cond.notify_all()
