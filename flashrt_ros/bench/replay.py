"""Replay throughput: a recorded policy session replayed in-process, as a multiple of real time.

The session is what a robot records in ten minutes: observations at 30 Hz into the node's
default policy (the embedded default with 23 observation and 7 action values), a snapshot every
two seconds, a rollback every four and a restore every eight, each older snapshot dropped. It
is recorded through the session layer into a journal, written to an MCAP bag, read back and
judged both ways (``replay.judge``) on a fresh engine. Target: >= 5x real time.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from ..replay.bag import read_bag, write_bag
from ..replay.journal import judge
from ..replay.session import session_of
from ..runtime import Engine
from ..serving.journal import Journal
from ..serving.session import Session
from .common import bench_main, machine, verdict

RATE_HZ = 30
OBS_DIM, ACTION_DIM = 23, 7
TARGET = 5.0


def _engine(steps: int) -> Engine:
    return Engine.load(None, policy_dims=(OBS_DIM, ACTION_DIM), max_seq_len=steps + 64, rollback_depth=16)


def record(steps: int) -> Journal:
    """The session, journaled: ``steps`` observations with its capsule calls in between."""
    engine = _engine(steps)
    session = Session(engine, Journal(session=session_of(engine, "", 0)))
    gen = torch.Generator().manual_seed(7)
    held: list[str] = []
    for i in range(1, steps + 1):
        session.step(torch.randn(OBS_DIM, generator=gen))
        if i % (2 * RATE_HZ) == 0:
            held.append(session.snapshot(name=f"t{i // RATE_HZ}").info.id)
        if i % (4 * RATE_HZ) == 0:
            session.rollback(steps=RATE_HZ // 3)
        if i % (8 * RATE_HZ) == 0:
            session.restore(held[-1])
        while len(held) > 2:
            session.drop(held.pop(0))
    engine.close()
    return session.journal


def run(seconds: float = 600.0) -> dict:
    steps = int(seconds * RATE_HZ)
    print(f"replay throughput on {machine()}: a {seconds:.0f} s policy session at {RATE_HZ} Hz ({steps} steps)")
    start = time.perf_counter()
    journal = record(steps)
    recorded_s = time.perf_counter() - start
    calls = sum(e.kind not in ("step",) for e in journal.entries)
    with tempfile.TemporaryDirectory(prefix="flashrt-bench-replay-") as folder:
        bag = write_bag(Path(folder) / "session", journal)
        size = sum(f.stat().st_size for f in bag.iterdir())
        start = time.perf_counter()
        entries = read_bag(bag).entries
        engine = _engine(steps)
        verdicts = judge(entries, engine)
        replay_s = time.perf_counter() - start
        engine.close()
    speed = seconds / replay_s
    print(f"  recorded {len(journal.entries)} operations ({steps} steps, {calls} capsule calls) in {recorded_s:.1f} s; "
          f"bag {size / 2**20:.1f} MiB")
    print(f"  replayed (bag read, engine built, both verdicts) in {replay_s:.1f} s: exact "
          f"{'identical' if verdicts.exact else 'differs'}, portable {'pass' if verdicts.portable else 'fail'}")
    check = verdict("replay speed, multiple of real time (in-process)", speed, TARGET, True)
    return {"checks": [check], "seconds": seconds, "steps": steps, "capsule_calls": calls, "record_s": recorded_s,
            "replay_s": replay_s, "real_time_multiple": speed, "bag_bytes": size,
            "exact": verdicts.exact, "portable": verdicts.portable}


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--seconds", type=float, default=600.0, help="length of the recorded session")

    bench_main(__doc__, options, lambda a: run(a.seconds), device=False)


if __name__ == "__main__":
    main()
