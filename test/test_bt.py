"""The py_trees behaviours and example trees against a live node, and their failure branches."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("rclpy")
py_trees = pytest.importorskip("py_trees")

from py_trees.common import Status  # noqa: E402

from flashrt_ros.errors import ErrorCode  # noqa: E402
from ros_harness import Harness  # noqa: E402


@pytest.fixture
def live(ros_context):
    py_trees.blackboard.Blackboard.clear()
    h = Harness(ros_context)
    yield h
    h.close()


def _tick_until_done(root, timeout: float = 30.0, shutdown: bool = True) -> Status:
    from flashrt_ros.bt.examples import run_tree

    return run_tree(root, period_s=0.005, timeout_s=timeout, shutdown=shutdown)


def _blackboard(key: str):
    return py_trees.blackboard.Blackboard.get(key)


def test_attempt_with_rollback_succeeds_after_rolling_back(live):
    from flashrt_ros.bt.examples import attempt_with_rollback

    root = attempt_with_rollback(live.client)
    assert _tick_until_done(root) == Status.SUCCESS
    grasps = {b.name: b for b in root.iterate() if b.name.startswith("grasp ") and hasattr(b, "attempts")}
    assert grasps["grasp 1"].attempts == grasps["grasp 2"].attempts == 1   # failed, rolled back, succeeded
    assert next(b for b in root.iterate() if b.name == "roll back 1").status == Status.SUCCESS
    assert live.node.engine.capsules.list() == []      # the checkpoint was released
    assert live.node.report.counters["policy_steps"] == 12


def test_a_failed_rollback_ends_the_tree_without_a_retry_and_drops_the_checkpoint(live):
    from flashrt_ros.bt.examples import attempt_with_rollback
    from flashrt_ros.errors import InvalidArgument

    def refuse(steps=1, to_position=None):
        raise InvalidArgument("cannot roll back (test)")
    live.node.engine.rollback = refuse
    root = attempt_with_rollback(live.client)
    assert _tick_until_done(root) == Status.FAILURE
    assert next(b for b in root.iterate() if b.name == "grasp 2").status == Status.INVALID   # never ran
    assert _blackboard("flashrt_error")["name"] == "INVALID_ARGUMENT"                       # the cause stays
    assert live.node.engine.capsules.list() == []
    # Nothing is left behind to make the next run fail.
    del live.node.engine.rollback
    py_trees.blackboard.Blackboard.clear()
    assert _tick_until_done(attempt_with_rollback(live.client)) == Status.SUCCESS


def test_a_failed_exploration_drops_the_forks_it_made_and_nothing_an_earlier_run_kept(live):
    from flashrt_ros.bt.examples import explore_and_commit

    assert _tick_until_done(explore_and_commit(live.client, branches=3)) == Status.SUCCESS
    kept = [c.id for c in live.node.engine.capsules.list()]            # the best end of the first run
    root = explore_and_commit(live.client, branches=3, tokens=600)   # past max_seq_len: "try 0" is refused
    assert _tick_until_done(root) == Status.FAILURE
    assert _blackboard("flashrt_error")["name"] == "INVALID_ARGUMENT"
    assert [c.id for c in live.node.engine.capsules.list()] == kept


def test_explore_and_commit_keeps_the_best_branch_and_drops_the_rest(live):
    from flashrt_ros.bt.examples import explore_and_commit

    root = explore_and_commit(live.client, branches=3)
    assert _tick_until_done(root) == Status.SUCCESS
    kept = live.node.engine.capsules.list()
    assert [c.id for c in kept] == [_blackboard("best")]
    assert live.node.engine.state_digest() == live.node.engine.capsules.get(kept[0].id).digest


def test_an_error_answer_fails_the_behaviour_and_reaches_the_blackboard(live):
    from flashrt_ros.bt.behaviours import Restore

    py_trees.blackboard.Blackboard.set("target", "no-such-capsule")
    behaviour = Restore("restore missing", live.client, "target")
    assert _tick_until_done(behaviour) == Status.FAILURE
    error = _blackboard("flashrt_error")
    assert error["code"] == ErrorCode.UNKNOWN_CAPSULE and error["name"] == "UNKNOWN_CAPSULE" and error["message"]


class _SlowSnapshotServer:
    """A /slow/snapshot service that answers after ``delay`` seconds, recording request ids."""

    def __init__(self, node, delay: float) -> None:
        from rclpy.callback_groups import ReentrantCallbackGroup

        from flashrt_ros.srv import Snapshot

        self.request_ids: list[str] = []
        self.delay = delay

        def answer(request, response):
            self.request_ids.append(request.request_id)
            time.sleep(self.delay)
            response.success, response.capsule_id = True, f"capsule-for-{request.request_id}"
            return response

        node.create_service(Snapshot, "/slow/snapshot", answer, callback_group=ReentrantCallbackGroup())


def test_timeout_fails_and_the_late_answer_is_ignored(live):
    from flashrt_ros.bt.behaviours import TIMEOUT, Snapshot

    server = _SlowSnapshotServer(live.client, delay=0.5)
    behaviour = Snapshot("slow snapshot", live.client, "slow_capsule", server="/slow", timeout_s=0.1)
    assert behaviour.client.wait_for_service(timeout_sec=10)
    assert _tick_until_done(behaviour, shutdown=False) == Status.FAILURE   # a retry is to come
    assert _blackboard("flashrt_error")["code"] == TIMEOUT
    deadline = time.monotonic() + 5
    while behaviour.late_answers == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert behaviour.late_answers == 1
    with pytest.raises(KeyError):
        _blackboard("slow_capsule")                  # the late answer wrote nothing
    # The retry reuses the request id: the node would answer with the same capsule.
    server.delay = 0.0
    assert _tick_until_done(behaviour) == Status.SUCCESS
    assert server.request_ids[0] == server.request_ids[1]
    assert _blackboard("slow_capsule") == f"capsule-for-{server.request_ids[0]}"


@pytest.mark.parametrize("make", ["restore", "rollback", "drop"])
def test_an_unset_or_mistyped_blackboard_key_fails_the_behaviour_not_the_tree(live, make):
    from flashrt_ros.bt.behaviours import Drop, Restore, Rollback

    behaviour = {"restore": lambda: Restore("restore", live.client, "never_set"),
                 "rollback": lambda: Rollback("rollback", live.client, to_position_key="never_set"),
                 "drop": lambda: Drop("drop", live.client, "never_set")}[make]()
    assert behaviour.client.wait_for_service(timeout_sec=10)
    assert _tick_until_done(behaviour) == Status.FAILURE
    assert _blackboard("flashrt_error")["code"] == ErrorCode.INVALID_ARGUMENT
    py_trees.blackboard.Blackboard.set("never_set", 12.5 if make != "rollback" else "twelve")
    assert _tick_until_done(behaviour) == Status.FAILURE
    assert _blackboard("flashrt_error")["code"] == ErrorCode.INVALID_ARGUMENT


def test_absent_server_fails_with_no_server(live):
    from flashrt_ros.bt.behaviours import NO_SERVER, Drop

    py_trees.blackboard.Blackboard.set("x", "whatever")
    behaviour = Drop("drop on nobody", live.client, "x", server="/nobody", wait_for_server_s=0.2)
    assert _tick_until_done(behaviour) == Status.FAILURE
    assert _blackboard("flashrt_error")["code"] == NO_SERVER


def test_a_snapshot_halted_mid_call_runs_anew_and_its_orphan_is_dropped(live):
    """A halted branch that runs again wants the state of then: a new request_id, and the
    capsule the halted call made (answered, unseen) is dropped when its lease ends."""
    from flashrt_ros.bt.behaviours import Snapshot

    from ros_harness import wait_future

    _, result = live.generate(prompt="context", max_new_tokens=2)
    assert wait_future(result).result.success
    behaviour = Snapshot("snap", live.client, "snap_capsule", lease_s=0.5)
    tree = py_trees.trees.BehaviourTree(behaviour)
    tree.setup(timeout=10)
    tree.tick()
    assert behaviour.status == Status.RUNNING
    first_id = behaviour.request_id
    behaviour.stop(Status.INVALID)                  # halted: the call is in flight or answered unseen
    assert first_id and behaviour.request_id == ""
    _, result = live.generate(max_new_tokens=3)     # the state moves on before the branch runs again
    assert wait_future(result).result.success
    behaviour.lease_s = 0.0                         # the run that is kept asks for no lease
    assert _tick_until_done(behaviour) == Status.SUCCESS
    deadline = time.monotonic() + 5
    while len(live.node.engine.capsules.list()) > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    capsules = live.node.engine.capsules.list()
    assert [c.id for c in capsules] == [_blackboard("snap_capsule")]
    assert capsules[0].position == live.node.engine.position   # the state of the second run


def test_a_snapshot_that_timed_out_then_was_halted_leaves_no_orphan_capsule(live):
    """The timed-out try keeps its request_id for a retry; a halt then means no retry will
    ever claim the capsule the node makes for it, so its lease ends it."""
    from flashrt_ros.bt.behaviours import Snapshot

    from ros_harness import wait_future

    _, result = live.generate(prompt="context", max_new_tokens=2)
    assert wait_future(result).result.success
    behaviour = Snapshot("snap", live.client, "snap_capsule", pin=True, timeout_s=0.2, lease_s=0.5)
    tree = py_trees.trees.BehaviourTree(behaviour)
    tree.setup(timeout=10)
    with live.node.engine.lock:                     # the node is busy past the timeout
        while behaviour.status != Status.FAILURE:
            tree.tick()
            time.sleep(0.01)
        assert behaviour.request_id                 # kept for a retry
        behaviour.stop(Status.INVALID)              # the branch is preempted instead
    deadline = time.monotonic() + 10
    while (behaviour.late_answers == 0 or live.node.engine.capsules.list()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert behaviour.late_answers == 1 and live.node.engine.capsules.list() == []


@pytest.mark.parametrize("make", ["snapshot", "fork"])
def test_a_timed_out_call_whose_tree_ends_leaves_no_capsule_once_the_tree_shuts_down(live, make):
    """No halt comes when a tree just ends: what late answers made ends with its lease."""
    from flashrt_ros.bt.behaviours import Fork, Snapshot
    from flashrt_ros.bt.examples import run_tree

    from ros_harness import wait_future

    _, result = live.generate(prompt="context", max_new_tokens=2)
    assert wait_future(result).result.success
    behaviour = (Snapshot("snap", live.client, "made", pin=True, timeout_s=0.2, lease_s=0.5) if make == "snapshot"
                 else Fork("fork", live.client, "made", timeout_s=0.2, lease_s=0.5))
    with live.node.engine.lock:                     # the node is busy past the timeout
        assert run_tree(behaviour, period_s=0.01, timeout_s=10) == Status.FAILURE
    deadline = time.monotonic() + 10
    while (behaviour.late_answers == 0 or live.node.engine.capsules.list()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert behaviour.late_answers == 1 and live.node.engine.capsules.list() == []


def test_unknown_codes_and_unsendable_values_fail_the_behaviour_not_the_tick(live):
    from flashrt_ros.bt.behaviours import Restore, Rollback
    from flashrt_ros.srv import Restore as RestoreSrv

    def odd(request, response):
        response.success, response.error_code, response.message = False, 42, "a code from a newer node"
        return response
    live.client.create_service(RestoreSrv, "/odd/restore", odd)
    py_trees.blackboard.Blackboard.set("target", "anything")
    behaviour = Restore("restore", live.client, "target", server="/odd")
    assert behaviour.client.wait_for_service(timeout_sec=10)
    assert _tick_until_done(behaviour) == Status.FAILURE
    assert _blackboard("flashrt_error")["code"] == 42 and _blackboard("flashrt_error")["name"] == "code 42"
    for key, value, make in [("position", 2**64, lambda: Rollback("rb", live.client, to_position_key="position")),
                             ("target", "caps\ud800", lambda: Restore("rs", live.client, "target"))]:
        py_trees.blackboard.Blackboard.set(key, value)
        behaviour = make()
        assert behaviour.client.wait_for_service(timeout_sec=10)
        assert _tick_until_done(behaviour) == Status.FAILURE
        assert _blackboard("flashrt_error")["code"] == ErrorCode.INVALID_ARGUMENT


def test_generate_whose_server_vanished_mid_goal_sends_anew_once_one_is_back(ros_context):
    """The canceled goal's end never comes from a server that is gone: it is waited for
    once (TIMEOUT), then a later run sends its goal to the server that is there now."""
    import threading

    from rclpy.executors import SingleThreadedExecutor

    from flashrt_ros.bt.behaviours import TIMEOUT, Generate

    from ros_harness import _client_node

    py_trees.blackboard.Blackboard.clear()
    client = _client_node(ros_context)
    behaviour = Generate("gen", client, "out", prompt="x", max_new_tokens=400, server="/vanishing", timeout_s=1.0)
    executor = SingleThreadedExecutor(context=ros_context)
    executor.add_node(client)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    tree = py_trees.trees.BehaviourTree(behaviour)

    def run() -> Status:
        tree.tick()
        deadline = time.monotonic() + 20
        while behaviour.status == Status.RUNNING and time.monotonic() < deadline:
            time.sleep(0.01)
            tree.tick()
        return behaviour.status

    try:
        first = Harness(ros_context, name="vanishing")
        tree.setup(timeout=10)
        tree.tick()
        deadline = time.monotonic() + 10
        while first.node.engine.position < 3 and time.monotonic() < deadline:
            time.sleep(0.005)
            tree.tick()
        first.close()                                   # the server goes, and its goal with it
        assert run() == Status.FAILURE and _blackboard("flashrt_error")["code"] == TIMEOUT
        second = Harness(ros_context, name="vanishing")
        try:
            assert behaviour.client.wait_for_server(timeout_sec=10)
            behaviour.max_new_tokens = 4
            outcomes = [run() for _ in range(2)]        # the first may still wait out the old goal
            assert Status.SUCCESS in outcomes, (outcomes, _blackboard("flashrt_error"))
        finally:
            second.close()
    finally:
        executor.shutdown(timeout_sec=5)
        spinner.join(5)
        client.destroy_node()


def _generating(live, result_key: str, max_new_tokens: int, position: int):
    """A Generate behaviour ticked until the node's position reaches ``position``: (behaviour, tree)."""
    from flashrt_ros.bt.behaviours import Generate

    behaviour = Generate(result_key, live.client, result_key, prompt="x", max_new_tokens=max_new_tokens)
    tree = py_trees.trees.BehaviourTree(behaviour)
    tree.setup(timeout=10)
    deadline = time.monotonic() + 10
    while live.node.engine.position < position and time.monotonic() < deadline:
        tree.tick()
        time.sleep(0.005)
    return behaviour, tree


def test_generate_halted_mid_goal_is_canceled_on_the_node(live):
    behaviour, _ = _generating(live, "long_result", 400, 5)
    behaviour.stop(Status.INVALID)
    time.sleep(0.5)
    position = live.node.engine.position
    time.sleep(0.3)
    assert live.node.engine.position == position < 400  # the node stopped generating
    assert not live.node.goals.running()


def test_generate_run_again_after_a_halt_waits_for_the_canceled_goal(live):
    behaviour, _ = _generating(live, "out", 400, 10)
    behaviour.stop(Status.INVALID)                   # preempted, then handed control back at once
    behaviour.max_new_tokens = 4
    assert _tick_until_done(behaviour) == Status.SUCCESS, _blackboard("flashrt_error")
    assert len(_blackboard("out")["tokens"]) == 4


def test_generate_halted_before_its_goal_was_accepted_then_run_again_is_not_refused_busy(live):
    """The halt comes before the goal handle: the goal starts on the node anyway, and the
    behaviour run again must wait for it to end instead of sending into a busy node."""
    from flashrt_ros.bt.behaviours import Generate

    for _ in range(3):   # the window is a few milliseconds wide: try it more than once
        behaviour = Generate("gen", live.client, "out", prompt="x", max_new_tokens=200)
        tree = py_trees.trees.BehaviourTree(behaviour)
        tree.setup(timeout=10)
        tree.tick()                                  # the goal request is in flight
        behaviour.stop(Status.INVALID)
        behaviour.max_new_tokens = 3
        assert _tick_until_done(behaviour) == Status.SUCCESS, _blackboard("flashrt_error")
        # Its own goal ran to its end: 3 tokens, or fewer ending at the model's stop token. Which
        # depends on how many tokens the canceled goal committed first, which is timing.
        tokens = _blackboard("out")["tokens"]
        assert len(tokens) == 3 or (0 < len(tokens) < 3 and tokens[-1] in live.node.engine.stop_token_ids), tokens


def test_generate_canceled_by_another_client_fails(live):
    from action_msgs.srv import CancelGoal

    from flashrt_ros.bt.behaviours import CANCELED
    from ros_harness import wait_future

    behaviour, tree = _generating(live, "plan", 300, 10)
    deadline = time.monotonic() + 10
    cancel = live.client.create_client(CancelGoal, "/flashrt/generate/_action/cancel_goal")
    assert cancel.wait_for_service(timeout_sec=5)
    wait_future(cancel.call_async(CancelGoal.Request()))   # another executive cancels every goal
    while behaviour.status == Status.RUNNING and time.monotonic() < deadline:
        tree.tick()
        time.sleep(0.005)
    assert behaviour.status == Status.FAILURE
    assert _blackboard("flashrt_error")["code"] == CANCELED


def test_tree_setup_against_an_absent_node_is_bounded_and_fails_at_the_first_tick(live):
    from flashrt_ros.bt.behaviours import NO_SERVER
    from flashrt_ros.bt.examples import explore_and_commit, run_tree

    start = time.monotonic()
    assert run_tree(explore_and_commit(live.client, server="/nobody"), setup_timeout_s=30) == Status.FAILURE
    assert time.monotonic() - start < 15
    assert _blackboard("flashrt_error")["code"] == NO_SERVER


def test_behaviortree_cpp_xml_mirrors_the_python_tree_and_names_real_services():
    import xml.etree.ElementTree as ET
    from pathlib import Path

    from ros_harness import SERVICES

    root = ET.parse(Path(__file__).resolve().parents[1] / "docs" / "attempt_with_rollback.xml").getroot()
    assert root.get("BTCPP_format") == "4"
    names = [e.get("name") for e in root.iter() if e.get("name")]
    assert names == ["attempt with rollback, cleaned up", "attempt with rollback, or clean up",
                     "attempt with rollback", "plan", "checkpoint",
                     "grasp 1, or roll back and try again", "grasp 1", "roll back 1", "roll back 1", "grasp 2",
                     "release checkpoint", "after a failure", "clean up checkpoint", "drop checkpoint", "then fail"]
    services = {e.get("service_name") for e in root.iter() if e.get("service_name")}
    assert services <= {f"/flashrt/{s}" for s in SERVICES}
    assert {e.get("action_name") for e in root.iter() if e.get("action_name")} == {"/flashrt/generate"}
    for e in root.iter():
        if e.tag.startswith("Flashrt"):   # the cleanup reports apart, so the task's own error stays
            prefix = "cleanup_" if e.get("name") == "drop checkpoint" else ""
            assert (e.get("error_code"), e.get("error_message")) == (f"{{{prefix}error_code}}",
                                                                   f"{{{prefix}error_message}}")


class _ManualFuture:
    """A future whose done callbacks run only when the test says, as on a busy executor thread."""

    def __init__(self) -> None:
        self._done, self._result, self._callbacks = False, None, []

    def add_done_callback(self, fn) -> None:
        self._callbacks.append(fn)

    def complete(self, result) -> None:
        self._done, self._result = True, result

    def run_callbacks(self) -> None:
        for fn in self._callbacks:
            fn(self)

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def exception(self):
        return None

    def result(self):
        return self._result


def _probe():
    from flashrt_ros.bt.behaviours import _Call

    class Probe(_Call):
        def __init__(self) -> None:
            super().__init__("probe", node=None, server="/x", timeout_s=30.0, error_key="probe_error")
            self.undone: list = []

        def _wait_for_server(self, seconds: float) -> None:
            pass

        def update(self) -> Status:
            return Status.RUNNING

        def _late(self, future) -> None:
            self.undone.append(future.result())

    return Probe()


def test_an_answer_already_taken_is_not_late_when_its_callback_runs_after():
    # The race that cancelled generate goals under load: update() took the goal handle
    # and moved on to the result future before the handle's done callback ran.
    probe = _probe()
    first, second = _ManualFuture(), _ManualFuture()
    probe._send(first)
    first.complete("goal handle")
    assert probe._poll() == "goal handle"
    probe._send(second)
    first.run_callbacks()
    assert probe.late_answers == 0 and probe.undone == []


@pytest.mark.parametrize("answered_before_halt", [False, True])
def test_an_answer_to_a_halted_call_is_late_exactly_once(answered_before_halt):
    probe = _probe()
    future = _ManualFuture()
    probe._send(future)
    if answered_before_halt:
        future.complete("accepted goal")
    probe.terminate(Status.INVALID)
    if not answered_before_halt:
        future.complete("accepted goal")
    future.run_callbacks()
    assert probe.late_answers == 1 and probe.undone == ["accepted goal"]


def test_generate_behaviours_can_be_made_while_their_node_spins(ros_context):
    # Kilted's rclpy adds an ActionClient to its node before the client has its lock; an
    # executor spinning that node died of it within ~70 plain clients made in a tight loop.
    import threading

    from flashrt_ros.action import Generate as GenerateAction
    from flashrt_ros.bt.behaviours import Generate, _ActionClient
    from ros_harness import spun_client

    py_trees.blackboard.Blackboard.clear()
    errors, previous = [], threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)
    try:
        with spun_client(ros_context) as node:
            behaviour = Generate("made while spinning", node, "made", server="/absent")
            clients = [_ActionClient(node, GenerateAction, f"/absent_{i}/generate") for i in range(300)]
            time.sleep(0.2)
    finally:
        threading.excepthook = previous
    assert isinstance(behaviour.client, _ActionClient) and len(clients) == 300
    assert errors == []
