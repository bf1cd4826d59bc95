"""The engine lock: reentrant, arrival-ordered, and what that buys a snapshot mid-generation."""
from __future__ import annotations

import threading
import time

import pytest

from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.runtime.fairlock import FairRLock


def _wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def test_reentrant_and_owner_checked():
    lock = FairRLock()
    with lock:
        with lock:
            assert lock.held_by_me()
        assert lock.held_by_me()
    assert not lock.held_by_me()
    with pytest.raises(RuntimeError):
        lock.release()


def test_waiters_get_the_lock_in_arrival_order():
    lock = FairRLock()
    order: list[int] = []
    threads = []
    lock.acquire()
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), order.append(i), lock.release()))
        t.start()
        threads.append(t)
        _wait_until(lambda: len(lock._queue) == i + 1)  # queued before the next one starts
    lock.release()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3, 4]


def test_timeout_leaves_the_queue_and_lets_the_next_waiter_through():
    lock = FairRLock()
    lock.acquire()
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("got", lock.acquire(timeout=0.05)))
    t.start()
    t.join(5)
    assert result["got"] is False and not lock._queue
    assert lock.acquire(blocking=False)  # reentrant for the owner
    lock.release()
    lock.release()
    assert lock.acquire(blocking=False)
    lock.release()


def test_snapshot_mid_generation_waits_for_at_most_the_step_in_progress():
    """Counted in decode steps, not timed: with an unfair lock the generating thread
    won the lock back for up to 83 steps in a row before the snapshot got it."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=2048)
    engine.prefill([1, 2, 3])
    stop = threading.Event()

    def generate():
        for _ in engine.stream(engine.max_seq_len - engine.position):
            if stop.is_set():
                break

    worker = threading.Thread(target=generate)
    worker.start()
    lags = []
    try:
        _wait_until(lambda: engine.position > 10)
        for _ in range(20):
            before = engine.position
            info = engine.snapshot()
            lags.append(info.position - before)
            time.sleep(0.02)
    finally:
        stop.set()
        worker.join(10)
    assert max(lags) <= 2, lags  # the step in progress plus the read of `before` racing it


def test_an_acquire_interrupted_while_queued_leaves_no_place_behind():
    """Ctrl-C lands in the main thread while it waits its turn: its place in the queue must go
    with it, or no thread ever gets the lock again."""
    import signal

    lock, held, go = FairRLock(), threading.Event(), threading.Event()

    def owner():
        with lock:
            held.set()
            go.wait()

    threading.Thread(target=owner, daemon=True).start()
    held.wait()

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    go.set()
    got = []
    other = threading.Thread(target=lambda: got.append(lock.acquire(timeout=5.0)))
    other.start()
    other.join()
    assert got == [True]
