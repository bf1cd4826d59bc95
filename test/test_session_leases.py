"""Capsules made with a lease: the session drops each once its lease has run out since it was
made or last used; a refusal changes nothing; the drops are journaled and replay."""
from __future__ import annotations

import math
import time

import pytest

from flashrt_ros.errors import InvalidArgument
from flashrt_ros.replay.journal import replay
from flashrt_ros.replay.session import session_of
from flashrt_ros.runtime import Engine, ModelConfig
from flashrt_ros.serving import Journal, Session


def _session(journal: bool = False) -> Session:
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    session = Session(engine, Journal(session=session_of(engine, "", 0)) if journal else None)
    list(session.generate([1, 2, 3], 2))
    return session


def _ids(session: Session) -> set[str]:
    return {c.id for c in session.list()}


def test_a_leased_capsule_is_dropped_once_its_lease_runs_out_and_an_unleased_one_stays():
    session = _session()
    leased = session.snapshot(lease_s=0.2).info
    kept = session.snapshot().info
    assert session.expire() == [] and _ids(session) == {leased.id, kept.id}
    time.sleep(0.3)
    assert [info.id for info in session.expire()] == [leased.id]
    assert _ids(session) == {kept.id}


def test_a_restore_a_fork_and_a_repeated_request_id_renew_the_lease():
    session = _session()
    made = session.snapshot(request_id="r1", lease_s=0.3).info
    for renew in (lambda: session.restore(made.id), lambda: session.fork(made.id),
                  lambda: session.snapshot(request_id="r1", lease_s=0.3)):
        time.sleep(0.2)
        renew()
        assert made.id not in {info.id for info in session.expire()}
    time.sleep(0.4)
    assert made.id in {info.id for info in session.expire()}


@pytest.mark.parametrize("lease", [-1.0, math.nan, math.inf, True, "10", 1e9])
def test_a_lease_out_of_range_is_refused_and_changes_nothing(lease):
    session = _session()
    digest = session.engine.state_digest()
    for call in (lambda: session.snapshot(lease_s=lease), lambda: session.fork(lease_s=lease)):
        with pytest.raises(InvalidArgument, match="lease_s must be"):
            call()
    assert session.list() == [] and session.engine.state_digest() == digest


def test_the_drops_a_lease_makes_are_journaled_and_the_journal_replays():
    session = _session(journal=True)
    session.snapshot(name="brief", lease_s=0.1)
    session.snapshot(name="kept")
    time.sleep(0.2)
    session.expire()
    list(session.generate([], 2))
    kinds = [e.kind for e in session.journal.entries]
    assert kinds[-3:] == ["drop", "decode", "decode"]
    fresh = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    report = replay(session.journal.entries, fresh)
    assert report.capsule_calls == 3 and [c.name for c in fresh.capsules.list()] == ["kept"]


def test_the_node_ends_a_lease_with_a_drop_event(ros_context):
    from flashrt_ros.msg import CapsuleEvent
    from ros_harness import Harness

    h = Harness(ros_context)
    try:
        events = []
        h.client.create_subscription(CapsuleEvent, "/flashrt/events", events.append, 100)
        time.sleep(0.3)
        made = h.call("snapshot", lease_s=0.2)
        assert made.success
        deadline = time.monotonic() + 10
        while not any(e.kind == "drop" for e in events) and time.monotonic() < deadline:
            time.sleep(0.02)
        drop = next(e for e in events if e.kind == "drop")
        assert drop.capsule.id == made.capsule_id and "lease" in drop.message and drop.success
        assert h.call("list_capsules").capsules == []
    finally:
        h.close()
