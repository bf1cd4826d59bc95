"""``Interruptible`` against a live node over DDS: an urgent request between a snapshot and a
restore, the task resumed on the state it had, and a lease that clears an interrupt that never
resumes."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("rclpy")
py_trees = pytest.importorskip("py_trees")

from py_trees.common import Status  # noqa: E402

from ros_harness import Harness, wait_future  # noqa: E402


@pytest.fixture
def live(ros_context):
    py_trees.blackboard.Blackboard.clear()
    h = Harness(ros_context)
    yield h
    h.close()


def _generate(h: Harness, prompt: str, n: int) -> list[int]:
    result = wait_future(h.generate(prompt=prompt, max_new_tokens=n)[1], 60).result
    assert result.success, result.message
    return list(result.tokens)


def _tree(h: Harness, lease_s: float = 60.0, urgent_tokens: int = 6):
    from flashrt_ros.bt.behaviours import Generate
    from flashrt_ros.bt.interruptible import Interruptible

    task = Generate("task", h.client, "task_result", prompt=" and then", max_new_tokens=6)
    urgent = Generate("urgent", h.client, "urgent_result", prompt=" URGENT: hold the cup level.",
                      max_new_tokens=urgent_tokens)
    return Interruptible("route", h.client, task, urgent, lease_s=lease_s)


def test_an_interrupted_task_resumes_on_the_state_it_had(live):
    from flashrt_ros.bt.examples import run_tree

    _generate(live, "Pick the red cup, then the blue one.", 1)
    engine = live.node.engine
    before, capsules = engine.position, len(engine.capsules.list())
    # What the task produces uninterrupted, from this state.
    mark = live.call("snapshot", lease_s=0.0)
    expected = _generate(live, " and then", 6)
    after = engine.position
    assert live.call("restore", capsule_id=mark.capsule_id).success
    assert live.call("drop_capsule", capsule_id=mark.capsule_id).success

    root = _tree(live)
    py_trees.blackboard.Blackboard.set("interrupt", True)   # the operator's request, before the task starts
    assert run_tree(root, period_s=0.005, timeout_s=60) == Status.SUCCESS
    assert root.interrupts == 1 and py_trees.blackboard.Blackboard.get("interrupt") is False
    assert py_trees.blackboard.Blackboard.get("urgent_result")["tokens"]      # the urgent request was served
    assert py_trees.blackboard.Blackboard.get("task_result")["tokens"] == expected
    assert engine.position == after > before
    assert len(engine.capsules.list()) == capsules                            # the interrupt's capsule dropped


def test_an_interrupt_mid_task_halts_it_and_the_task_runs_again_after_the_restore(live):
    from flashrt_ros.bt.examples import run_tree

    _generate(live, "Visit A, then B, then C.", 1)
    root = _tree(live)
    tree = py_trees.trees.BehaviourTree(root)
    tree.setup(timeout=30)
    deadline = time.monotonic() + 60
    while root.task.status != Status.RUNNING:   # the task's goal is in flight
        tree.tick()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    py_trees.blackboard.Blackboard.set("interrupt", True)
    tree.tick()
    assert root.task.status == Status.INVALID and root.serve.status == Status.RUNNING   # halted; serving
    assert run_tree(root, period_s=0.005, timeout_s=60) == Status.SUCCESS
    assert root.interrupts == 1
    assert live.node.engine.capsules.list() == []


def test_an_interrupt_that_never_resumes_leaves_no_capsule_once_its_lease_ends(live):
    _generate(live, "Stack the blocks.", 1)
    root = _tree(live, lease_s=1.0, urgent_tokens=200)
    tree = py_trees.trees.BehaviourTree(root)
    tree.setup(timeout=30)
    py_trees.blackboard.Blackboard.set("interrupt", True)
    deadline = time.monotonic() + 60
    while not live.node.engine.capsules.list():   # snapshot taken, urgent request running
        tree.tick()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    root.stop(Status.INVALID)   # the tree is abandoned mid-interrupt
    tree.shutdown()
    assert root.abandoned == 1 and py_trees.blackboard.Blackboard.get("interrupt") is False   # not served twice
    while live.node.engine.capsules.list():
        assert time.monotonic() < deadline, "the interrupt's capsule outlived its lease"
        time.sleep(0.05)


def test_a_failed_restore_fails_the_interruptible_instead_of_resuming_another_state(live):
    from flashrt_ros.bt.behaviours import Drop, Generate
    from flashrt_ros.bt.examples import run_tree
    from flashrt_ros.bt.interruptible import Interruptible

    _generate(live, "Open the drawer.", 1)
    task = Generate("task", live.client, "task_result", prompt=" and then", max_new_tokens=6)
    # An urgent branch that drops the interrupt's capsule: the restore cannot find it.
    urgent = py_trees.composites.Sequence("urgent, then lose the capsule", memory=True, children=[
        Generate("urgent", live.client, "urgent_result", prompt=" x", max_new_tokens=2),
        Drop("lose it", live.client, "route_capsule")])
    root = Interruptible("route", live.client, task, urgent)
    py_trees.blackboard.Blackboard.set("interrupt", True)
    assert run_tree(root, period_s=0.005, timeout_s=60) == Status.FAILURE
    assert root.task.status == Status.INVALID   # the task did not run on the urgent request's state
    assert py_trees.blackboard.Blackboard.get("flashrt_error")["name"] == "UNKNOWN_CAPSULE"
    assert py_trees.blackboard.Blackboard.get("interrupt") is False   # over: a tick again does not serve it again
