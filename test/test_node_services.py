"""The node over real rclpy and DDS: every service's success path and its refusals."""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from ros_harness import Harness, wait_future  # noqa: E402


@pytest.fixture
def live(ros_context, tmp_path):
    h = Harness(ros_context, {"capsule_dir": str(tmp_path / "capsules")})
    yield h
    h.close()


def _prefill(h: Harness, n: int = 24) -> None:
    _, result = h.generate(token_ids=list(range(1, n + 1)), max_new_tokens=0)
    assert wait_future(result).result.success


def _ok(response) -> None:
    assert response.success, response.message
    assert response.error_code == ErrorCode.OK


def _refused(response, code: ErrorCode) -> None:
    assert not response.success
    assert response.error_code == code, (ErrorCode(response.error_code).name, response.message)
    assert response.message


def test_every_service_success_path(live):
    h = live
    _prefill(h)
    snap = h.call("snapshot", name="start", tier="host", pin=True, request_id="a")
    _ok(snap)
    assert snap.position == 24 and snap.capsule.tier == "host" and snap.capsule.pinned
    assert snap.latency_ms > 0
    disk = h.call("snapshot", name="on-disk", tier="disk")
    _ok(disk)
    assert list((Path(h.node.get_parameter("capsule_dir").value)).glob("*")), "disk tier wrote nothing"
    fork = h.call("fork", source_id=snap.capsule_id, name="branch")
    _ok(fork)
    assert fork.capsule.parent == snap.capsule_id and fork.source_id == snap.capsule_id
    live_fork = h.call("fork", name="from-live")
    _ok(live_fork)
    assert live_fork.source_id == ""

    _, result = h.generate(max_new_tokens=5)  # continue from the live state
    assert wait_future(result).result.position == 29
    back = h.call("rollback", steps=2, to_position=-1)
    _ok(back)
    assert back.position == 27
    one = h.call("rollback", steps=1)   # only steps set, as `ros2 service call ... "{steps: 1}"` sends
    _ok(one)
    assert one.position == 26, "an unset to_position must mean unused, not position 0"
    exact = h.call("rollback", steps=0, to_position=25)
    _ok(exact)
    assert exact.position == 25
    assert h.call("rollback").position == 24   # an empty request: one boundary back (the prefill's)

    restored = h.call("restore", capsule_id=snap.capsule_id, verify=True)
    _ok(restored)
    assert restored.position == 24 and restored.capsule_id == snap.capsule_id
    assert h.node.engine.state_digest() == h.node.engine.capsules.get(snap.capsule_id).digest

    listed = h.call("list_capsules")
    _ok(listed)
    assert {c.name for c in listed.capsules} == {"start", "on-disk", "branch", "from-live"}
    host_only = h.call("list_capsules", tier="host")
    assert sorted(c.name for c in host_only.capsules) == ["branch", "start"]  # a fork lives with its source

    dropped = h.call("drop_capsule", capsule_id="branch")
    _ok(dropped)
    assert dropped.capsule_id == fork.capsule_id
    assert len(h.call("list_capsules").capsules) == 3


def test_refusals_carry_a_code_and_a_message_and_the_node_keeps_serving(live, tmp_path):
    h = live
    _prefill(h)
    before = h.node.engine.state_digest()
    cases = [
        ("restore", {"capsule_id": "no-such-capsule"}, ErrorCode.UNKNOWN_CAPSULE),
        ("restore", {"capsule_id": ""}, ErrorCode.INVALID_ARGUMENT),
        ("drop_capsule", {"capsule_id": "no-such-capsule"}, ErrorCode.UNKNOWN_CAPSULE),
        ("fork", {"source_id": "no-such-capsule"}, ErrorCode.UNKNOWN_CAPSULE),
        ("snapshot", {"tier": "moon"}, ErrorCode.INVALID_ARGUMENT),
        ("list_capsules", {"tier": "moon"}, ErrorCode.INVALID_ARGUMENT),
        ("rollback", {"steps": -1, "to_position": -1}, ErrorCode.INVALID_ARGUMENT),
        ("rollback", {"steps": 100, "to_position": -1}, ErrorCode.INVALID_ARGUMENT),
        ("rollback", {"to_position": 10_000}, ErrorCode.INVALID_ARGUMENT),
        ("rollback", {"to_position": -2}, ErrorCode.INVALID_ARGUMENT),
        ("snapshot", {"request_id": "x" * 300}, ErrorCode.INVALID_ARGUMENT),
    ]
    for name in ("../escape", "../../etc/passwd", "/abs/path", "a/b", "..", ".hidden", "nul\x01byte", "x" * 200):
        cases.append(("snapshot", {"name": name, "tier": "disk"}, ErrorCode.INVALID_ARGUMENT))
        cases.append(("fork", {"name": name}, ErrorCode.INVALID_ARGUMENT))
    for service, fields, code in cases:
        _refused(h.call(service, **fields), code)
    assert h.node.engine.state_digest() == before, "a refused request changed the live state"
    outside = [p for p in tmp_path.rglob("*") if p.is_file() and "capsules" not in p.parts]
    assert outside == [], f"files written outside capsule_dir: {outside}"
    _ok(h.call("snapshot", name="still-serving"))


def test_request_id_makes_snapshot_idempotent(live):
    h = live
    _prefill(h)
    first = h.call("snapshot", name="s", request_id="bt-tick-7")
    again = h.call("snapshot", name="s", request_id="bt-tick-7")
    _ok(first)
    _ok(again)
    assert again.capsule_id == first.capsule_id and "repeat" in again.message
    assert len(h.call("list_capsules").capsules) == 1
    _refused(h.call("snapshot", name="other", request_id="bt-tick-7"), ErrorCode.INVALID_ARGUMENT)
    _ok(h.call("drop_capsule", capsule_id=first.capsule_id))
    _refused(h.call("snapshot", name="s", request_id="bt-tick-7"), ErrorCode.UNKNOWN_CAPSULE)


def test_a_snapshot_retry_answers_the_capsule_it_made_whatever_happened_since(live):
    """A behaviour tree that timed out retries later: the answer is the first capsule and
    its position (what the tree rolls back to), even after more tokens and a new default tier."""
    from rclpy.parameter import Parameter

    h = live
    _prefill(h, 19)
    first = h.call("snapshot", request_id="tick-1")
    _, result = h.generate(max_new_tokens=5)
    assert wait_future(result).result.success
    assert h.node.set_parameters([Parameter("default_tier", value="host")])[0].successful
    again = h.call("snapshot", request_id="tick-1")
    _ok(again)
    assert again.capsule_id == first.capsule_id and again.position == first.position == 19


def test_fork_answers_the_id_it_forked_from_also_when_asked_by_name(live):
    h = live
    _prefill(h)
    start = h.call("snapshot", name="start")
    fork = h.call("fork", source_id="start", name="branch")
    _ok(fork)
    assert fork.source_id == start.capsule_id == fork.capsule.parent


def test_a_tiny_status_rate_is_refused_and_the_node_keeps_serving(live):
    from rclpy.parameter import Parameter

    h = live
    before = h.node.get_parameter("status_rate").value
    result = h.node.set_parameters([Parameter("status_rate", value=1e-12)])[0]
    assert not result.successful and "status_rate" in result.reason
    assert h.node.get_parameter("status_rate").value == before
    _prefill(h)
    _ok(h.call("snapshot"))


def test_inactive_node_answers_not_active_to_everything(live):
    h = live
    h.node.trigger_deactivate()
    for service, fields in [("snapshot", {}), ("restore", {"capsule_id": "x"}), ("fork", {}),
                            ("rollback", {"steps": 1, "to_position": -1}), ("list_capsules", {}),
                            ("drop_capsule", {"capsule_id": "x"})]:
        _refused(h.call(service, **fields), ErrorCode.NOT_ACTIVE)
    _, result = h.generate(prompt="hi", max_new_tokens=2)
    _refused(wait_future(result).result, ErrorCode.NOT_ACTIVE)
    h.node.trigger_cleanup()
    assert h.node.engine is None
    _refused(h.call("list_capsules"), ErrorCode.NOT_ACTIVE)
    h.node.trigger_configure()
    h.node.trigger_activate()
    _ok(h.call("list_capsules"))


def test_a_goal_aborted_by_deactivation_reports_the_tokens_it_committed(live, monkeypatch):
    h = live
    # Not this test's subject, and up to the seeded weights: the model ending the goal with
    # its stop token before the deactivation (it did at the second token with this prompt).
    monkeypatch.setattr(h.node.engine, "stop_token_ids", ())
    monkeypatch.setattr(h.node.tokenizer, "eos_id", None)
    _, result = h.generate(token_ids=[1, 2, 3], max_new_tokens=400)
    deadline = time.monotonic() + 30
    while h.node.engine.position < 8 and time.monotonic() < deadline:
        time.sleep(0.002)
    h.node.trigger_deactivate()
    answer = wait_future(result).result
    assert not answer.success and answer.error_code == ErrorCode.NOT_ACTIVE
    committed = h.node.engine.position - 3
    assert committed >= 5 and len(answer.tokens) == committed
    assert list(answer.tokens) == h.node.engine.arena["meta.tokens"][3:3 + committed, 0].tolist()


@pytest.mark.parametrize("then", ["cancel", "deactivate"])
def test_a_goal_canceled_or_deactivated_while_it_waits_for_the_lock_commits_no_prompt(live, then):
    """The lock stands in for a long call of another client's. The goal's checks before the
    lock passed; those made once it holds the lock must stop the prompt."""
    h = live
    engine = h.node.engine
    with engine.lock:
        handle, result = h.generate(token_ids=list(range(1, 101)), max_new_tokens=10)
        time.sleep(0.3)   # the goal is accepted; what it finds when it gets the lock is the same either way
        if then == "cancel":
            assert len(wait_future(handle.cancel_goal_async()).goals_canceling) == 1
        else:
            h.node.trigger_deactivate()
    answer = wait_future(result).result
    assert engine.position == 0 and len(answer.tokens) == 0
    if then == "cancel":
        assert answer.success and "canceled" in answer.message
    else:
        assert answer.error_code == ErrorCode.NOT_ACTIVE and "before the prompt" in answer.message


def test_generate_streams_feedback_reports_ttft_and_matches_the_engine(live):
    from flashrt_ros.runtime import Engine, ModelConfig
    from flashrt_ros.runtime.tokenizer import ByteTokenizer

    h = live
    seen = []
    _, result = h.generate(prompt="pick the red cube", max_new_tokens=12, feedback=lambda f: seen.append(
        list(f.feedback.tokens)))
    res = wait_future(result).result
    assert res.success, res.message
    assert res.ttft_ms > 0 and res.position == len(ByteTokenizer().encode("pick the red cube")) + len(res.tokens)
    reference = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
    reference.prefill(ByteTokenizer().encode("pick the red cube"))
    expected = reference.generate(12)
    stop = expected.index(257) + 1 if 257 in expected else 12
    assert list(res.tokens) == expected[:stop]
    # Feedback travels on a topic and the result through a service, with no order between them, and
    # rclpy's client drops a goal's feedback once its result is in: the last tokens' feedback may
    # never be seen (nor one a full feedback queue let go). What streams must be ever longer
    # prefixes of the result's tokens.
    assert seen, "no feedback streamed"
    assert all(tokens == list(res.tokens[:len(tokens)]) for tokens in seen), seen
    assert all(len(a) < len(b) for a, b in zip(seen, seen[1:])), seen


def test_a_sampled_goal_draws_what_the_engine_draws_and_its_journal_replays(live):
    from flashrt_ros.replay.journal import replay
    from flashrt_ros.serving.journal import Journal
    from flashrt_ros.runtime import Engine, ModelConfig

    h = live
    h.node.session.journal = journal = Journal()
    _, result = h.generate(token_ids=[5, 6, 7], max_new_tokens=12, temperature=1.0, seed=21)
    res = wait_future(result).result
    assert res.success, res.message
    reference = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
    reference.prefill([5, 6, 7])
    drawn = reference.generate(12, temperature=1.0, seed=21)
    stop = drawn.index(257) + 1 if 257 in drawn else 12
    assert list(res.tokens) == drawn[:stop] and h.node.engine.sampling_seed == 21
    fresh = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
    assert replay(list(journal.entries), fresh).tokens == len(res.tokens)
    assert fresh.state_digest() == h.node.engine.state_digest()
    for bad in (-0.5, float("nan"), float("inf")):
        _, result = h.generate(token_ids=[1], max_new_tokens=2, temperature=bad)
        _refused(wait_future(result).result, ErrorCode.INVALID_ARGUMENT)


def test_a_speculative_goal_gives_plain_decodes_tokens_and_bad_drafts_are_refused(live):
    """The goal's field, or the node's parameter when the field is -1; a refusal commits nothing."""
    from rclpy.parameter import Parameter

    from flashrt_ros.runtime import Engine, ModelConfig

    h = live
    reference = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
    reference.prefill([9, 8, 7])
    expected = reference.generate(40)
    expected = expected[:expected.index(257) + 1] if 257 in expected else expected
    _, result = h.generate(token_ids=[9, 8, 7], max_new_tokens=40, speculative=2)
    res = wait_future(result).result
    assert res.success and list(res.tokens) == expected, res.message
    before = h.node.engine.speculation_stats
    assert before.passes > 0
    for bad in (-2, 99):
        _, result = h.generate(token_ids=[1, 2], max_new_tokens=4, speculative=bad)
        _refused(wait_future(result).result, ErrorCode.INVALID_ARGUMENT)
    assert h.node.engine.position == 3 + len(expected)   # neither prompt was committed
    assert h.node.set_parameters([Parameter("speculative", value=3)])[0].successful
    _, result = h.generate(max_new_tokens=6)   # -1: the node's parameter
    assert wait_future(result).result.success
    # Asked to speculate: a pass, or a plain token while the seeded head's rejections keep it off.
    after = h.node.engine.speculation_stats
    assert after.passes + after.plain_tokens > before.passes + before.plain_tokens


def test_generate_refusals_and_cancel(live):
    h = live
    for goal, code in [({"token_ids": [999_999]}, ErrorCode.INVALID_ARGUMENT),
                       ({"prompt": "x", "max_new_tokens": 10_000}, ErrorCode.INVALID_ARGUMENT),
                       ({"max_new_tokens": 3}, ErrorCode.INVALID_ARGUMENT),           # empty prompt, empty state
                       ({"prompt": "x", "max_new_tokens": -1}, ErrorCode.INVALID_ARGUMENT)]:
        _, result = h.generate(**goal)
        _refused(wait_future(result).result, code)
    assert h.node.engine.position == 0

    streamed = []
    handle, result = h.generate(prompt="a long answer", max_new_tokens=400, feedback=streamed.append)
    deadline = time.monotonic() + 30
    while len(streamed) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    # One goal waits behind the running one (the node's queue is one deep); a third is refused.
    with h.node.engine.lock:   # the running goal waits at its next token meanwhile
        assert h.node.generating()
        _, queued = h.generate(prompt="second", max_new_tokens=2)
        deadline = time.monotonic() + 30
        while h.node.goals.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        _, busy = h.generate(prompt="third", max_new_tokens=2)
        _refused(wait_future(busy).result, ErrorCode.BUSY)
        wait_future(handle.cancel_goal_async())
    res = wait_future(result).result
    assert res.success and 0 < len(res.tokens) < 400 and "canceled" in res.message
    second = wait_future(queued).result   # ran once the first had stopped at a committed boundary
    assert second.success and second.position == res.position + len(h.node.tokenizer.encode("second")) + \
        len(second.tokens) == h.node.engine.position, second.message


def test_a_goal_canceled_while_it_waits_ends_canceled_and_commits_nothing(live):
    h = live
    streamed = []
    handle, result = h.generate(prompt="a long answer", max_new_tokens=400, feedback=streamed.append)
    deadline = time.monotonic() + 30
    while len(streamed) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    with h.node.engine.lock:
        waiting_handle, waiting = h.generate(prompt="never run", max_new_tokens=2)
        while h.node.goals.waiting < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        wait_future(waiting_handle.cancel_goal_async())
        res = wait_future(waiting).result
        assert res.success and not res.tokens and "waited" in res.message
        wait_future(handle.cancel_goal_async())
    first = wait_future(result).result
    assert first.success and first.position == h.node.engine.position   # nothing of the second goal


def test_a_restore_during_a_goal_stops_it_there_as_preempted(live):
    """The goal extends the state it started from; a Restore between two tokens replaces that
    state, so the goal stops (PREEMPTED) and reports only the tokens it made before."""
    from flashrt_ros.runtime import Engine, ModelConfig

    h = live
    _prefill(h)
    start = h.call("snapshot", name="start")
    _ok(start)
    _, result = h.generate(max_new_tokens=400)   # continues the live state
    deadline = time.monotonic() + 30
    while h.node.engine.position < 24 + 5 and time.monotonic() < deadline:
        time.sleep(0.002)
    _ok(h.call("restore", capsule_id=start.capsule_id))
    answer = wait_future(result).result
    assert not answer.success and answer.error_code == ErrorCode.PREEMPTED, answer.message
    assert "restore or rollback" in answer.message
    assert answer.position == h.node.engine.position == 24   # nothing committed after the restore
    reference = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512)
    reference.prefill(list(range(1, 25)))
    assert len(answer.tokens) >= 5 and list(answer.tokens) == reference.generate(len(answer.tokens))


def test_snapshot_echoes_its_request_id_and_a_live_fork_takes_the_default_tier(live):
    h = live
    _prefill(h)
    traced = h.call("snapshot", request_id="trace-42")
    _ok(traced)
    assert "trace-42" in traced.message
    _ok(h.call("snapshot"))
    from rclpy.parameter import Parameter

    assert h.node.set_parameters([Parameter("default_tier", value="host")])[0].successful
    plain = h.call("snapshot")
    fork = h.call("fork", name="live-branch")
    _ok(plain)
    _ok(fork)
    assert plain.capsule.tier == fork.capsule.tier == "host"
    assert h.call("fork", source_id=fork.capsule_id).capsule.tier == "host"   # a capsule's fork: its tier


def test_events_status_and_diagnostics_are_published(live):
    from diagnostic_msgs.msg import DiagnosticArray

    from flashrt_ros.msg import CapsuleEvent, RuntimeStatus
    from ros_harness import STATUS_QOS as status_qos

    h = live
    events, statuses, diags = [], [], []
    h.client.create_subscription(CapsuleEvent, "/flashrt/events", events.append, 100)
    h.client.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
    _prefill(h)
    time.sleep(0.5)  # discovery of the subscriptions
    snap = h.call("snapshot", name="e")
    h.call("restore", capsule_id=snap.capsule_id)
    h.call("restore", capsule_id="missing")
    h.call("rollback", steps=0, to_position=-1)
    # Once the snapshot is hashed, a fork of it carries that digest: same bytes, not hashed again.
    h.node.engine.capsules.get(snap.capsule_id)
    h.call("fork", source_id=snap.capsule_id)
    h.call("drop_capsule", capsule_id=snap.capsule_id)
    # A late subscriber still gets the last status (transient_local).
    h.client.create_subscription(RuntimeStatus, "/flashrt/status", statuses.append, status_qos)
    # The status timer publishes within a poll period of a change, so the late subscriber
    # may first get the status from before the drop; wait for the one after it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (len(events) < 6 or not diags or not statuses
                                           or statuses[-1].capsule_count != 1):
        time.sleep(0.05)
    # Digests are announced when the background hash finishes, whenever that is.
    kinds = [(e.kind, e.success) for e in events if e.kind != "digest"]
    assert kinds == [("snapshot", True), ("restore", True), ("restore", False), ("rollback", True),
                     ("fork", True), ("drop", True)]
    answered = [e for e in events if e.kind != "digest"]
    assert answered[0].capsule.digest == ""   # the Snapshot answer did not wait for the hash
    assert answered[2].error_code == ErrorCode.UNKNOWN_CAPSULE
    fork_id = answered[4].capsule.id
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [e for e in events if e.kind == "digest"]:
        time.sleep(0.05)
    announced = [e.capsule for e in events if e.kind == "digest"]
    final = h.call("list_capsules").capsules
    assert [c.id for c in final] == [fork_id]
    assert [c.id for c in announced] == [snap.capsule_id]
    assert answered[4].capsule.digest == final[0].digest == announced[0].digest != ""
    status = statuses[-1]
    assert status.lifecycle_state == "active" and status.position == 24 and status.capsule_count == 1
    assert status.state_digest == h.node.engine.state_digest()
    values = {kv.key: kv.value for kv in diags[-1].status[0].values}
    assert values["graph_mode"] == "eager" and "snapshot_latency_ms" in values



def test_lifecycle_services_drive_the_node_as_a_lifecycle_manager_would(ros_context):
    """What Nav2's lifecycle manager calls: ~/get_state and ~/change_state."""
    from lifecycle_msgs.msg import Transition
    from lifecycle_msgs.srv import ChangeState, GetState

    h = Harness(ros_context, activate=False)
    try:
        get = h.client.create_client(GetState, "/flashrt/get_state")
        change = h.client.create_client(ChangeState, "/flashrt/change_state")
        assert get.wait_for_service(timeout_sec=10) and change.wait_for_service(timeout_sec=10)

        def state() -> str:
            return wait_future(get.call_async(GetState.Request())).current_state.label

        def go(transition_id: int) -> bool:
            request = ChangeState.Request()
            request.transition.id = transition_id
            return wait_future(change.call_async(request)).success

        assert state() == "unconfigured"
        assert h.call("list_capsules").error_code == ErrorCode.NOT_ACTIVE
        assert go(Transition.TRANSITION_CONFIGURE) and state() == "inactive"
        assert go(Transition.TRANSITION_ACTIVATE) and state() == "active"
        _ok(h.call("snapshot"))
        # A transition the state does not have (a manager that retries): refused, and the
        # executor lives on (rclpy raised out of the callback, which stopped it).
        assert not go(Transition.TRANSITION_CONFIGURE) and not go(99) and state() == "active"
        assert h._thread.is_alive()
        _ok(h.call("snapshot"))
        assert go(Transition.TRANSITION_DEACTIVATE) and state() == "inactive"
        assert go(Transition.TRANSITION_CLEANUP) and state() == "unconfigured"
        assert h.node.engine is None
    finally:
        h.close()


def test_capsule_services_have_their_own_thread_which_destroy_node_stops(ros_context):
    """The six capsule services answer even when no executor spins the lifecycle node
    (a lean helper node on its own thread serves them), and destroy_node stops that thread."""
    from rclpy.parameter import Parameter

    from flashrt_ros.ros.node import FlashRTNode
    from ros_harness import SERVICES, spun_client

    node = FlashRTNode("flashrt_lean", context=ros_context,
                       parameter_overrides=[Parameter("max_seq_len", value=256), Parameter("status_rate", value=0.0)])
    services = node._capsule_services
    with spun_client(ros_context) as client:  # nobody spins ``node``
        try:
            node.trigger_configure()
            node.trigger_activate()
            calls = {k: client.create_client(t, f"/flashrt_lean/{k}") for k, t in SERVICES.items()}
            assert all(c.wait_for_service(timeout_sec=10) for c in calls.values())
            _ok(wait_future(calls["snapshot"].call_async(SERVICES["snapshot"].Request(name="lean"))))
            listed = wait_future(calls["list_capsules"].call_async(SERVICES["list_capsules"].Request()))
            assert [c.name for c in listed.capsules] == ["lean"]
            _refused(wait_future(calls["restore"].call_async(SERVICES["restore"].Request(capsule_id="nope"))),
                     ErrorCode.UNKNOWN_CAPSULE)
            assert services.alive
        finally:
            node.destroy_node()
    assert not services.alive


def test_a_process_wide_node_rename_names_the_side_nodes_apart():
    """launch renames a node with process-wide __node/__ns remaps; the side nodes that serve
    the capsule services and the generate action must not take the same name, and keep
    wall-clock time when the process is given sim time."""
    import rclpy
    from rclpy.action import ActionClient
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from flashrt_ros.action import Generate
    from flashrt_ros.ros.node import FlashRTNode
    from ros_harness import SERVICES, spun_client

    context = Context()
    rclpy.init(context=context, args=["--ros-args", "-r", "__node:=brain", "-r", "__ns:=/arm",
                                      "-p", "use_sim_time:=true"])
    node = None
    try:
        node = FlashRTNode(context=context, parameter_overrides=[Parameter("max_seq_len", value=256)])
        assert node.get_fully_qualified_name() == "/arm/brain" and node.get_parameter("use_sim_time").value
        for side in (node._capsule_services.node, node.goals._side.node):
            assert side.get_fully_qualified_name() in ("/arm/brain_capsule_services", "/arm/brain_generate")
            assert side.get_parameter("use_sim_time").value is False
        with spun_client(context) as client:
            restore = client.create_client(SERVICES["restore"], "/arm/brain/restore")
            assert restore.wait_for_service(timeout_sec=10)
            answer = wait_future(restore.call_async(SERVICES["restore"].Request(capsule_id="x")))
            _refused(answer, ErrorCode.NOT_ACTIVE)
            generate = ActionClient(client, Generate, "/arm/brain/generate")
            assert generate.wait_for_server(timeout_sec=10)
            handle = wait_future(generate.send_goal_async(Generate.Goal(prompt="hi", max_new_tokens=2)))
            result = wait_future(handle.get_result_async()).result
            assert not result.success and result.error_code == ErrorCode.NOT_ACTIVE
    finally:
        if node is not None:
            node.destroy_node()
        context.try_shutdown()


def test_remaps_of_the_nodes_private_service_names_move_the_capsule_services():
    """``~/restore:=...`` means the node's ``~``: the side nodes must resolve the names as the
    node itself does, or such a rule is silently ignored. The generate action's likewise."""
    import rclpy
    from rclpy.action import get_action_server_names_and_types_by_node
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from flashrt_ros.ros.node import FlashRTNode

    context = Context()
    rclpy.init(context=context, args=["--ros-args", "-r", "~/restore:=/robot/restore",
                                      "-r", "~/generate:=/robot/generate"])
    node = None
    try:
        node = FlashRTNode(context=context, parameter_overrides=[Parameter("max_seq_len", value=256)])
        names = {name for name, _ in node._capsule_services.node.get_service_names_and_types_by_node(
            node._capsule_services.node.get_name(), node._capsule_services.node.get_namespace())}
        assert {"/robot/restore", "/flashrt/fork"} <= names and "/flashrt/restore" not in names
        side = node.goals._side.node
        actions = {name for name, _ in get_action_server_names_and_types_by_node(side, side.get_name(),
                                                                                 side.get_namespace())}
        assert actions == {"/robot/generate"}
    finally:
        if node is not None:
            node.destroy_node()
        context.try_shutdown()


def test_a_default_goal_keeps_the_states_seed(live):
    from flashrt_ros.action import Generate

    h = live
    assert Generate.Goal().seed == -1   # an unset field, as any client language sends it
    _, result = h.generate(token_ids=[5, 6, 7], max_new_tokens=2, temperature=1.0, seed=7)
    assert wait_future(result).result.success
    goal = Generate.Goal(max_new_tokens=2)
    handle = wait_future(h.generate_client.send_goal_async(goal))
    assert wait_future(handle.get_result_async()).result.success
    assert h.node.engine.sampling_seed == 7


def test_a_rollback_past_the_ring_names_the_capsule_it_started_from(live):
    h = live
    _prefill(h)
    checkpoint = h.call("snapshot", name="checkpoint")
    _ok(checkpoint)
    _, result = h.generate(max_new_tokens=20)
    assert len(wait_future(result).result.tokens) == 20   # no eos from this prompt on the tiny model
    back = h.call("rollback", to_position=26)
    _ok(back)
    assert back.position == 26 and back.capsule_id == checkpoint.capsule_id
    within_ring = h.call("rollback", steps=1)
    _ok(within_ring)
    assert within_ring.capsule_id == ""


def test_a_request_whose_handler_raises_costs_that_answer_not_the_services(live):
    h = live
    serve = h.node._answer

    def broken(*args, **kwargs):
        raise RuntimeError("injected fault outside the request's own error handling")

    h.node._answer = broken
    with pytest.raises(TimeoutError):
        h.call("list_capsules", timeout=2)
    h.node._answer = serve
    _ok(h.call("list_capsules"))
    _ok(h.call("snapshot"))
    assert h.node._capsule_services.alive and h.node._capsule_services.failures == 1


def test_a_status_the_engine_cannot_give_is_counted_and_the_node_serves_on(live):
    """A sticky engine fault (a CUDA error, say) in the status timer: it once stopped the
    executor, and with it the lifecycle, parameter and action services."""
    h = live
    engine = h.node.engine
    digest = engine.state_digest

    def faulty() -> str:
        raise RuntimeError("injected: an engine fault while the status is made")

    engine.state_digest = faulty
    try:
        h.node.session._version += 1   # a new state: the status must hash it
        h.node.report.dirty.set()
        deadline = time.monotonic() + 10
        while h.node.report.counters["status_failures"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine.state_digest = digest
    assert h.node.report.counters["status_failures"] >= 1 and h._thread.is_alive()
    _ok(h.call("snapshot"))
    _, result = h.generate("hello", max_new_tokens=2)   # the action server shares the timer's executor
    assert wait_future(result).result.success


def test_a_pose_from_before_cleanup_is_forgotten(live):
    from geometry_msgs.msg import PoseStamped

    h = live
    io = h.node.served.policy
    io._on_pose(PoseStamped())
    assert io._latest_pose is not None
    h.node.trigger_deactivate()
    h.node.trigger_cleanup()
    assert h.node.served is None   # the pose went with it
    h.node.trigger_configure()
    assert h.node.served.policy._latest_pose is None


@contextmanager
def _active_node_in_a_context_of_its_own(name: str):
    """(context, node): the test may shut that context down under the live node."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from flashrt_ros.ros.node import FlashRTNode

    context = Context()
    rclpy.init(context=context)
    node = None
    try:
        node = FlashRTNode(name, context=context,
                           parameter_overrides=[Parameter("max_seq_len", value=256), Parameter("status_rate", value=0.0)])
        node.trigger_configure()
        node.trigger_activate()
        yield context, node
    finally:
        if node is not None:
            node.destroy_node()
        context.try_shutdown()


def test_a_status_or_event_that_meets_a_shut_down_context_is_dropped_quietly(capfd):
    """A SIGTERM shuts the context down while the status timer or a service is between
    making its message and publishing it. Nobody is left to hear it: that is not a fault to
    count, and a traceback in the log of a clean stop reads as a crash."""
    from ros_harness import SERVICES

    with _active_node_in_a_context_of_its_own("flashrt_stopping") as (context, node):
        node.publish_status()
        assert node.report.counters["status_failures"] == 0
        context.shutdown()
        capfd.readouterr()
        node.publish_status()
        answer = SERVICES["snapshot"].Response(success=True, position=0, latency_ms=0.1)
        node.report.event("snapshot", None, answer)
        assert node.report.counters["status_failures"] == 0
        assert "Traceback" not in capfd.readouterr().err


def test_a_generate_goal_cut_by_shutdown_ends_without_a_traceback(capfd):
    """A SIGTERM during a long goal: its next feedback meets a dead context. The goal ends
    there, logged as stopped, not as an internal failure with a traceback."""
    import threading

    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    h = Harness(context, {"max_seq_len": 512})
    try:
        first = threading.Event()
        engine = h.node.engine
        h.generate("hello", max_new_tokens=400, feedback=lambda _: first.set())
        assert first.wait(30), "no feedback came"
        # Jazzy's shutdown leaves the node be, and the goal's next feedback meets a dead
        # context; Kilted's destroys the node first, and the goal finds it inactive.
        context.shutdown()
        deadline = time.monotonic() + 30
        while h.node.goals.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not h.node.goals.running(), "the goal did not end after the shutdown"
        assert engine.position < 400
        err = capfd.readouterr().err
        assert "Traceback" not in err, err
        assert "generate stopped by shutdown" in err or h.node.engine is None, err   # Kilted: see above
    finally:
        h.close()
        context.try_shutdown()


def test_a_context_shutdown_with_the_node_alive_is_prompt():
    """Kilted's Context.shutdown destroys the nodes it tracks while holding the context's
    lock, on which the services' thread waits: stopping it waited out a 5 s join."""
    with _active_node_in_a_context_of_its_own("flashrt_prompt") as (context, _):
        started = time.monotonic()
        context.shutdown()
        assert time.monotonic() - started < 3.0


def test_stopping_the_services_waits_for_a_handler_in_flight(ros_context):
    """rclpy's executor shutdown returns at once whatever its timeout: the engine must not
    be freed under a request still being answered."""
    import threading

    from rclpy.node import Node

    from flashrt_ros.ros.services import CapsuleServices
    from flashrt_ros.srv import ListCapsules
    from ros_harness import spun_client

    entered, finished = threading.Event(), threading.Event()

    def slow(request, response):
        entered.set()
        time.sleep(2.0)   # longer than stop()'s join of the thread: only its wait for handlers covers it
        finished.set()
        return response

    owner = Node("flashrt_owner", context=ros_context)
    services = CapsuleServices(owner, [(ListCapsules, "list_capsules", slow)])
    try:
        with spun_client(ros_context) as client:
            call = client.create_client(ListCapsules, "/flashrt_owner/list_capsules")
            assert call.wait_for_service(timeout_sec=10)
            call.call_async(ListCapsules.Request())
            assert entered.wait(10)
            services.stop()
            assert finished.is_set(), "stop() returned while the handler was still running"
            assert not services.alive
    finally:
        owner.destroy_node()
