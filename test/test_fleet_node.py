"""The fleet tier on one node in this process, against a real server: what configure checks,
what /diagnostics and ~/events say of the server, and requests for a tier the node lacks."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("rclpy")

from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus  # noqa: E402

from flashrt_ros.errors import ErrorCode  # noqa: E402
from ros_harness import Harness, wait_future  # noqa: E402

KEY = b"fleet-node-test-key-" + b"n" * 12


def _until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


def _fleet_entries(diagnostics: list) -> list:
    return [s for d in diagnostics for s in d.status if s.name.endswith(": fleet")]


def test_diagnostics_and_events_follow_the_server(ros_context, kv_server, tmp_path):
    from flashrt_ros.msg import CapsuleEvent

    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    h = Harness(ros_context, {"fleet.url": kv_server.url, "capsule_key_file": str(key_file), "status_rate": 10.0})
    try:
        events, diagnostics = [], []
        h.client.create_subscription(CapsuleEvent, "/flashrt/events", events.append, 50)
        h.client.create_subscription(DiagnosticArray, "/diagnostics", diagnostics.append, 50)
        _until(lambda: any(s.level == DiagnosticStatus.OK for s in _fleet_entries(diagnostics)),
               what="a reachable fleet tier on /diagnostics")
        assert wait_future(h.generate(prompt="shared context", max_new_tokens=1)[1]).result.success
        # A node with a fleet tier names each capsule's chunks with its digest: a publish sends at once.
        local = h.call("snapshot", name="here", tier="host")
        served = h.node.served
        assert served.engine.capsules.chunk_names(local.capsule.id,
                                                  served.fleet.chunking(served.engine.capsules.layout)) is not None
        published = h.call("snapshot", name="ctx", tier="fleet")
        assert published.success and published.capsule.tier == "fleet", published.message
        _until(lambda: any(int(v.value) > 0 for s in _fleet_entries(diagnostics[-3:]) for v in s.values
                           if v.key == "bytes_sent"), what="bytes sent on /diagnostics")

        kv_server.stop()
        _until(lambda: any(e.kind == "fleet" and e.error_code == ErrorCode.FLEET_UNAVAILABLE for e in events),
               what="a fleet event saying the server is gone")
        _until(lambda: any(s.level == DiagnosticStatus.ERROR for s in _fleet_entries(diagnostics[-3:])),
               what="an unreachable fleet tier on /diagnostics")
        kv_server.start()
        _until(lambda: any(e.kind == "fleet" and e.success for e in events[-3:]),
               what="a fleet event saying the server answers again")
    finally:
        h.close()


def test_a_fleet_url_without_a_key_is_refused_at_configure(ros_context):
    h = Harness(ros_context, {"fleet.url": "redis://127.0.0.1:6379/0"}, activate=False)
    try:
        from lifecycle_msgs.msg import State

        h.node.trigger_configure()
        assert h.node.served is None and h.node.label == "unconfigured"
        assert h.node._state_machine.current_state[0] == State.PRIMARY_STATE_UNCONFIGURED
    finally:
        h.close()


def test_a_bad_fleet_url_fails_the_configure_and_keeps_nothing(ros_context, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    h = Harness(ros_context, {"fleet.url": "http://not-a-server", "capsule_key_file": str(key_file)},
                activate=False)
    try:
        h.node.trigger_configure()
        assert h.node.served is None and h.node.label == "unconfigured"
    finally:
        h.close()


def test_tier_fleet_on_a_node_without_one_is_refused_and_changes_nothing(ros_context):
    h = Harness(ros_context)
    try:
        before = h.call("list_capsules")
        for service, fields in (("snapshot", {"tier": "fleet"}), ("restore", {"capsule_id": "x", "tier": "fleet"}),
                                ("fork", {"tier": "fleet"}), ("list_capsules", {"tier": "fleet"})):
            answer = h.call(service, **fields)
            assert not answer.success and answer.error_code == ErrorCode.INVALID_ARGUMENT, (service, answer.message)
            assert "fleet.url" in answer.message
        after = h.call("list_capsules")
        assert after.position == before.position and len(after.capsules) == len(before.capsules)
    finally:
        h.close()
