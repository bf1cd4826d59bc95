"""Capsule digests computed in the background, with exact accounting of what they hold.

A digest job reads its capsule's chunks, so it holds them until it is settled.
A capsule that leaves the store (dropped or evicted) settles its job at once:
a job not yet started is cancelled, one in progress is waited for (one hash
at most). So the bytes a tier counts are always those of the capsules in it,
whatever the worker thread is doing. Budget decisions, and with them refusals
and evictions, are then the same in a live run and in its replay. A record's
digest is final once its job is FINISHED (or it has no job).

``submit`` does not wake the worker. A woken worker at once competes for the
interpreter lock with the thread that just took the snapshot, in the middle of
its latency-critical call and the caller's next ones. The owner wakes it with
``kick`` as it starts its next long step, or waits for the digest itself; an
engine left idle has its queue picked up by the worker's poll (every ``POLL_S``).
A snapshot that must spill a capsule not hashed yet hashes it in the call.
"""
from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)

QUEUED, RUNNING, FINISHED, SETTLED = "queued", "running", "finished", "settled"
POLL_S = 1.0   # an idle worker wakes once a second: a negligible cost, and a bound on the wait


class Job:
    __slots__ = ("record", "pieces", "state", "waited")

    def __init__(self, record: Any, pieces: list) -> None:
        self.record, self.pieces, self.state = record, pieces, QUEUED
        self.waited = False   # a thread holding ``lock`` waits for it, and settles it itself


class DigestQueue:
    """``compute(record, pieces)`` runs on a worker thread; ``release(pieces)`` runs under ``lock``;
    ``announce(record)`` runs once the job is settled, so that it may call back into the store
    (a listener that asks for the final info would otherwise wait for its own running job)."""

    def __init__(self, compute: Callable[[Any, list], None], release: Callable[[list], None], lock: Any,
                 announce: Callable[[Any], None]) -> None:
        # Weak: the worker thread must not keep a dropped engine's store (and its memory) alive.
        self._compute_ref, self._release_ref = weakref.WeakMethod(compute), weakref.WeakMethod(release)
        self._announce_ref = weakref.WeakMethod(announce)
        self._lock = lock
        # One lock, two conditions: the worker waits for work on ``_cond``, callers wait for a
        # running job on ``_done``. Sharing one condition woke the worker for every finished
        # job, and its spurious turn for the interpreter delayed the caller's next call.
        guard = threading.Lock()
        self._cond = threading.Condition(guard)
        self._done = threading.Condition(guard)
        self._queue: deque[Job | None] = deque()
        self._worker = threading.Thread(target=self._run, name="capsule-digest", daemon=True)
        self._worker.start()

    def submit(self, record: Any, pieces: list) -> None:
        """Hash ``record`` later (see ``kick``); ``pieces`` must already be held for the job."""
        record.job = Job(record, pieces)
        # No lock: a deque's append is atomic, the worker is not woken here, and one it
        # misses is found by the next kick or poll (one lock round fewer on every snapshot).
        self._queue.append(record.job)

    def kick(self) -> None:
        """Start on the queued jobs now (a no-op costing a fraction of a microsecond when none is)."""
        if self._queue:
            with self._cond:
                self._cond.notify()

    def settle(self, record: Any) -> None:
        """Release what the record's job holds, now (call with ``lock`` held). A job not yet
        started is cancelled (the record is leaving the store); one running is waited for."""
        job = getattr(record, "job", None)
        if job is None:
            return
        with self._cond:
            if job.state == QUEUED:
                self._queue.remove(job)
                job.state = FINISHED
            if job.state == RUNNING:
                # The worker announces FINISHED before it takes the lock, so this wait ends.
                job.waited = True
                self._done.wait_for(lambda: job.state != RUNNING)
        self._settle(job)

    def finish(self, record: Any) -> None:
        """Make the record's digest final and release its job's hold, now (``lock`` held).
        A queued job runs in this thread: waiting for the worker could deadlock, since the
        worker may be waiting for ``lock`` to settle the job before it."""
        job = getattr(record, "job", None)
        if job is None:
            return
        with self._cond:
            here = job.state == QUEUED
            if here:
                self._queue.remove(job)
                job.state = RUNNING
        if here:
            try:
                self._compute(record, job.pieces)
            except Exception:
                log.exception("digest of capsule %s failed", record.info.id)
            with self._cond:
                job.state = FINISHED
                self._done.notify_all()
        else:
            with self._cond:  # the worker may be hashing this very record: no lock needed for that
                if job.state == RUNNING:
                    job.waited = True
                    self._done.wait_for(lambda: job.state != RUNNING)
        self._settle(job)
        if here:
            self._announce(record)

    def close(self) -> None:
        """Finish the queued jobs and stop (call without ``lock``: the worker needs it)."""
        with self._cond:
            self._queue.append(None)
            self._cond.notify()
        self._worker.join()

    @property
    def alive(self) -> bool:
        return self._worker.is_alive()

    def _compute(self, record: Any, pieces: list) -> None:
        compute = self._compute_ref()
        if compute is not None:
            compute(record, pieces)

    def _announce(self, record: Any) -> None:
        announce = self._announce_ref()
        if announce is not None:
            announce(record)

    def _settle(self, job: Job) -> None:
        with self._cond:
            if job.state == SETTLED:
                return
            job.state = SETTLED
        release = self._release_ref()
        if release is not None:
            release(job.pieces)
        job.pieces = []   # the record keeps its job: the chunks must not outlive the hold

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._compute_ref() is None:
                        return  # the store is gone: nothing will ever be queued again
                    self._cond.wait(timeout=POLL_S)
                job = self._queue.popleft()
                if job is None:
                    return
                job.state = RUNNING
            self._work_on(job)

    def _work_on(self, job: Job) -> None:
        try:
            self._compute(job.record, job.pieces)
        except Exception:  # a digest failure must never kill the worker
            log.exception("digest of capsule %s failed", job.record.info.id)
        finally:
            # Finished first, settled after: a waiter may hold the lock the release needs.
            with self._cond:
                if job.state == RUNNING:
                    job.state = FINISHED
                self._done.notify_all()
                mine = not job.waited
            if mine:  # else the waiter settles it: queueing for its lock would only delay its next call
                with self._lock:
                    self._settle(job)
            self._announce(job.record)
