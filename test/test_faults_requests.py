"""Hostile requests, a bounded soak and budget pressure against a live node (real rclpy and DDS)."""
from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from ros_harness import Harness, wait_future  # noqa: E402

CODES = {int(c) for c in ErrorCode}
INT32 = st.integers(-2**31, 2**31 - 1)
INT64 = st.integers(-2**63, 2**63 - 1)
HOSTILE_TEXT = st.one_of(
    st.sampled_from(["", ".", "..", "../", "../../etc/passwd", "/etc/passwd", "a/b", "\\windows\\x", "~", "~/x",
                     "-rf", "$(rm -rf /)", "%s%s%n", "\u202e\u0000", "con", "nul", " ", "a" * 129, "x" * 100_000,
                     "device", "host", "disk", "DEVICE", "disk\x00", "é" * 64, "💥"]),
    st.text(max_size=300),
    st.text(alphabet=st.sampled_from(list("./\\~-_ aZ09\x00\n\t")), max_size=64),
)
TALLY = {"tried": 0, "answered": 0}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import rclpy
    from rclpy.context import Context

    folder = tmp_path_factory.mktemp("fuzz")
    context = Context()
    rclpy.init(context=context)
    h = Harness(context, {"capsule_dir": str(folder / "capsules")})
    _, result = h.generate(token_ids=list(range(1, 40)), max_new_tokens=0)
    assert wait_future(result).result.success
    h.call("snapshot", name="anchor", pin=True)
    yield h, folder
    h.close()
    context.try_shutdown()


def _answered(h, service: str, **fields) -> None:
    TALLY["tried"] += 1
    try:
        h.clients[service].srv_type.Request(**fields)   # what the client side would refuse to send
    except (ValueError, TypeError, AssertionError):
        TALLY["answered"] += 1  # refused by the message type on this side; nothing reached the node
        return
    response = h.call(service, timeout=30, **fields)
    assert response.error_code in CODES and response.error_code != ErrorCode.INTERNAL, response.message
    assert response.success == (response.error_code == ErrorCode.OK)
    assert response.success or response.message
    TALLY["answered"] += 1


_FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@_FUZZ
@given(name=HOSTILE_TEXT, tier=HOSTILE_TEXT, pin=st.booleans(), request_id=HOSTILE_TEXT)
def test_fuzz_snapshot(live, name, tier, pin, request_id):
    _answered(live[0], "snapshot", name=name, tier=tier, pin=pin, request_id=request_id)


@_FUZZ
@given(capsule_id=HOSTILE_TEXT, verify=st.booleans())
def test_fuzz_restore(live, capsule_id, verify):
    _answered(live[0], "restore", capsule_id=capsule_id, verify=verify)


@_FUZZ
@given(source_id=HOSTILE_TEXT, name=HOSTILE_TEXT)
def test_fuzz_fork(live, source_id, name):
    _answered(live[0], "fork", source_id=source_id, name=name)


@_FUZZ
@given(steps=INT32, to_position=INT64)
def test_fuzz_rollback(live, steps, to_position):
    _answered(live[0], "rollback", steps=steps, to_position=to_position)


@_FUZZ
@given(tier=HOSTILE_TEXT)
def test_fuzz_list(live, tier):
    _answered(live[0], "list_capsules", tier=tier)


@_FUZZ
@given(capsule_id=HOSTILE_TEXT)
def test_fuzz_drop(live, capsule_id):
    if capsule_id == "anchor":
        return  # keep the pinned anchor for the checks below
    _answered(live[0], "drop_capsule", capsule_id=capsule_id)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=HOSTILE_TEXT, token_ids=st.lists(INT32, max_size=20),
       max_new_tokens=st.one_of(st.integers(-2**31, 4), st.just(2**31 - 1)))
def test_fuzz_generate(live, prompt, token_ids, max_new_tokens):
    h = live[0]
    TALLY["tried"] += 1
    try:
        from flashrt_ros.action import Generate

        Generate.Goal(prompt=prompt, token_ids=token_ids, max_new_tokens=max_new_tokens)
    except (ValueError, TypeError, AssertionError):
        TALLY["answered"] += 1
        return
    position = h.node.engine.position
    if position > 400:  # keep room for the rest of the fuzz
        h.call("restore", capsule_id="anchor")
    _, result = h.generate(prompt=prompt, token_ids=token_ids, max_new_tokens=max_new_tokens)
    res = wait_future(result, 60).result
    assert res.error_code in CODES and res.error_code != ErrorCode.INTERNAL, res.message
    assert res.success or res.message
    TALLY["answered"] += 1


def test_zz_after_the_fuzz_the_node_serves_and_wrote_nothing_outside_capsule_dir(live):
    h, folder = live
    outside = [p for p in folder.rglob("*") if p.is_file() and "capsules" not in p.relative_to(folder).parts]
    assert outside == []
    assert h.call("restore", capsule_id="anchor", verify=True).success
    assert TALLY["tried"] == TALLY["answered"] > 0
    print(f"FAULT hostile requests (6 services + generate, hypothesis) | tried {TALLY['tried']} | "
          f"handled {TALLY['answered']} | lost 0")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def test_soak_and_budget_pressure_keep_memory_bounded_pins_and_the_replay_digest(ros_context, tmp_path):
    """Mixed calls from 3 threads, generation and policy steps under tight budgets, bounded in
    time and count. Evictions happen and each one is announced; pinned capsules survive."""
    from flashrt_ros.msg import CapsuleEvent
    from flashrt_ros.replay import Journal, replay
    from flashrt_ros.replay.session import engine_for, session_of
    from test_node_policy_params import _joint_state, _pose

    budgets = {"budgets.device_mb": 1, "budgets.host_mb": 2, "budgets.disk_mb": 3}
    h = Harness(ros_context, {"capsule_dir": str(tmp_path / "capsules"), "max_seq_len": 2048, **budgets})
    engine = h.node.engine
    h.node.session.journal = journal = Journal(session=session_of(engine, "", 0))
    events: list = []
    h.client.create_subscription(CapsuleEvent, "/flashrt/events", events.append, 1000)
    try:
        _, result = h.generate(token_ids=list(range(1, 200)), max_new_tokens=0)
        assert wait_future(result).result.success
        pinned = h.call("snapshot", name="pinned-task", pin=True).capsule_id
        warm = _rss_mb()
        stop = time.monotonic() + 40
        answers, failures, lock = [], [], threading.Lock()
        ids = [pinned]

        def client(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(150):
                    if time.monotonic() > stop:
                        return
                    op = rng.random()
                    if op < 0.35:
                        r = h.call("snapshot", tier=rng.choice(["device", "host", "disk"]))
                        if r.success:
                            with lock:
                                ids.append(r.capsule_id)
                    elif op < 0.6:
                        r = h.call("restore", capsule_id=rng.choice(ids))
                    elif op < 0.7:
                        r = h.call("fork", source_id=rng.choice(ids))
                    elif op < 0.85:
                        r = h.call("rollback", steps=rng.randint(0, 3), to_position=-1)
                    elif op < 0.95:
                        r = h.call("list_capsules")
                    else:
                        r = h.call("drop_capsule", capsule_id=rng.choice(ids[1:] or ["none"]))
                    answers.append(r.error_code)
            except Exception as exc:  # collected: a thread's failure must fail the test
                failures.append(exc)

        def generator() -> None:
            try:
                while time.monotonic() < stop and h.node.engine.position < 1800:
                    _, res = h.generate(max_new_tokens=16)
                    answers.append(wait_future(res, 120).result.error_code)
            except Exception as exc:
                failures.append(exc)

        joints, poses = h.policy_publishers()
        time.sleep(0.3)
        poses.publish(_pose())
        threads = [threading.Thread(target=client, args=(s,)) for s in range(3)] + [threading.Thread(target=generator)]
        for t in threads:
            t.start()
        steps = 0
        while any(t.is_alive() for t in threads[:3]) and steps < 100:
            joints.publish(_joint_state([0.01 * steps] * 7))
            steps += 1
            time.sleep(0.02)
        for t in threads:
            t.join(120)
        time.sleep(0.5)
        grew = _rss_mb() - warm

        assert not failures, failures
        assert all(c != ErrorCode.INTERNAL for c in answers)
        listed = {c.id for c in engine.capsules.list()}
        assert pinned in listed, "a pinned capsule was evicted"
        for tier in ("device", "host", "disk"):
            assert engine.capsules.used_bytes(tier) <= engine.capsules.budget_bytes(tier)
        evicted = [e for e in events if e.kind == "evict"]
        spilled = [e for e in events if e.kind == "spill"]
        assert evicted and spilled, "the budgets were never under pressure"
        # Nothing lost silently: every capsule ever made is listed, dropped by a request, or announced evicted.
        dropped = {e.capsule.id for e in events if e.kind == "drop" and e.success}
        made = {e.capsule.id for e in events if e.kind in ("snapshot", "fork") and e.success}
        unaccounted = made - listed - dropped - {e.capsule.id for e in evicted}
        assert not unaccounted, f"capsules gone without an event: {unaccounted}"
        assert grew < 150, f"RSS grew {grew:.0f} MB during the soak"

        with engine.lock:
            final = engine.state_digest()
            entries = list(journal.entries)
        fresh = engine_for(journal.session)
        report = replay(entries, fresh)
        assert fresh.state_digest() == final
        print(f"FAULT soak (40 s, {len(answers)} calls + {report.tokens} tokens + {report.actions} steps) | "
              f"tried {len(answers)} | handled {len(answers)} | lost 0; RSS +{grew:.0f} MB")
        print(f"FAULT budget pressure (spill on) | tried {len(spilled) + len(evicted)} moves | handled "
              f"{len(spilled) + len(evicted)} | {len(spilled)} spills, {len(evicted)} evictions, all announced | lost 0")
    finally:
        h.close()


def test_budget_pressure_without_spill_refuses_and_keeps_every_capsule(ros_context):
    h = Harness(ros_context, {"spill": False, "budgets.device_mb": 1})
    try:
        _, result = h.generate(token_ids=list(range(1, 100)), max_new_tokens=0)
        assert wait_future(result).result.success
        made, refused = [], 0
        for _ in range(40):
            _, res = h.generate(max_new_tokens=2)
            wait_future(res)
            r = h.call("snapshot")
            if r.success:
                made.append(r.capsule_id)
            else:
                assert r.error_code == ErrorCode.BUDGET_EXCEEDED and "budget" in r.message.lower()
                refused += 1
        assert refused > 0, "the device budget was never reached"
        assert {c.id for c in h.node.engine.capsules.list()} == set(made)
        print(f"FAULT budget pressure (spill off) | tried {refused} refusals | handled {refused} | lost 0")
    finally:
        h.close()


def test_a_reused_request_id_with_megabyte_fields_gets_a_short_refusal():
    """The fields of a retry are not checked yet when its request_id is looked up: the refusal
    must not echo them whole into the answer, the event and the log."""
    from flashrt_ros.errors import InvalidArgument
    from flashrt_ros.serving.requests import SnapshotRequests

    requests = SnapshotRequests()
    requests.remember("r1", ("a", "", False), "0123456789abcdef")
    with pytest.raises(InvalidArgument) as refused:
        requests.earlier("r1", ("x" * 2_000_000, "y" * 2_000_000, False))
    assert len(str(refused.value)) < 500 and "a request_id names one snapshot" in str(refused.value)
