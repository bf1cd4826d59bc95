"""Example trees, each runnable against a live node with one command:

    python -m flashrt_ros.bt.examples attempt-with-rollback [--server /flashrt]
    python -m flashrt_ros.bt.examples explore-and-commit [--branches 3]

attempt-with-rollback: plan (generate), snapshot before the risky grasp, try
it; on failure roll back to the snapshot's position and try again (the first
attempt fails on purpose). A rollback that fails ends the tree in FAILURE: a
retry from a state that was not rolled back would be a different task. The
snapshot is dropped however the tree ends, halts aside. (Rollback replays
from the nearest kept boundary; Restore of the snapshot would do the same in
one copy.)

explore-and-commit: fork N branches of the live state, run each for a few
tokens and snapshot its end, keep the best end as the live state, drop the
rest; on a failure, drop what the tree made so far.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any, Sequence

import py_trees
from py_trees.common import Status
from py_trees.composites import Selector, Sequence as Seq
from py_trees.behaviours import Failure, UnsetBlackboardVariable
from py_trees.decorators import FailureIsSuccess

from .behaviours import Drop, Fork, Generate, Restore, Rollback, Snapshot
from .skills import PickBest, PolicySteps

JOINTS = tuple(f"joint{i}" for i in range(1, 8))


def attempt_with_rollback(node: Any, server: str = "/flashrt", joints: Sequence[str] = JOINTS,
                          fail_attempts: int = 1, steps: int = 6) -> py_trees.behaviour.Behaviour:
    # Attempt k: grasp, or else roll back and go on to attempt k + 1 (a rollback that
    # fails fails the whole chain). The first ``fail_attempts`` grasps fail on purpose.
    attempt: py_trees.behaviour.Behaviour = PolicySteps(
        f"grasp {fail_attempts + 1}", node, joints, steps=steps, server=server)
    for k in range(fail_attempts, 0, -1):
        attempt = Selector(f"grasp {k}, or roll back and try again", memory=True, children=[
            PolicySteps(f"grasp {k}", node, joints, steps=steps, server=server, fail_attempts=1),
            Seq(f"roll back {k}", memory=True, children=[
                Rollback(f"roll back {k}", node, to_position_key="checkpoint_position", server=server),
                attempt]),
        ])
    task = Seq("attempt with rollback", memory=True, children=[
        Generate("plan", node, "plan", prompt="plan: pick the red cube, place it on the tray.",
                 max_new_tokens=8, server=server),
        Snapshot("checkpoint", node, "checkpoint", pin=True, position_key="checkpoint_position", server=server),
        attempt,
        Drop("release checkpoint", node, "checkpoint", server=server),
    ])
    return _cleaned_up(task, node, server, ["checkpoint"])


def _cleaned_up(task: py_trees.behaviour.Behaviour, node: Any, server: str,
                keys: Sequence[str]) -> py_trees.behaviour.Behaviour:
    """``task``, or, when it fails, drop the capsules it left in ``keys`` and fail.

    The keys are cleared first, so that a failure drops only what this run made, never
    a capsule an earlier run kept (explore-and-commit keeps its best end). The drops
    report to their own error key, so the task's own error stays on the blackboard."""
    forget = [UnsetBlackboardVariable(f"forget {key}", key) for key in keys]
    cleanup = [FailureIsSuccess(f"clean up {key}", Drop(f"drop {key}", node, key, if_set=True, server=server,
                                                        error_key="flashrt_cleanup_error"))
               for key in keys]   # each one tried: a capsule dropped already is no reason to stop
    return Seq(f"{task.name}, cleaned up", memory=True, children=[*forget, Selector(
        f"{task.name}, or clean up", memory=True, children=[
            task, Seq("after a failure", memory=True, children=[*cleanup, Failure("then fail")])])])


def explore_and_commit(node: Any, server: str = "/flashrt", branches: int = 3,
                       tokens: int = 6) -> py_trees.behaviour.Behaviour:
    forks = [Fork(f"fork {i}", node, f"branch{i}", server=server) for i in range(branches)]
    explore = [Seq(f"explore {i}", memory=True, children=[
        Restore(f"enter {i}", node, f"branch{i}", server=server),
        Generate(f"try {i}", node, f"result{i}", prompt=f" option {i}:", max_new_tokens=tokens, server=server),
        Snapshot(f"end {i}", node, f"end{i}", server=server),
    ]) for i in range(branches)]
    losers = [f"loser{j}" for j in range(branches - 1)]
    task = Seq("explore and commit", memory=True, children=[
        Generate("context", node, "context", prompt="task: sort the parts by colour.", max_new_tokens=4,
                 server=server),
        *forks, *explore,
        PickBest("pick best", [f"result{i}" for i in range(branches)], [f"end{i}" for i in range(branches)],
                 "best", losers),
        Restore("commit best", node, "best", server=server),
        *[Drop(f"drop fork {i}", node, f"branch{i}", server=server) for i in range(branches)],
        *[Drop(f"drop {key}", node, key, server=server) for key in losers],
    ])
    # After a failure the ends may not have been picked yet: drop every branch and end.
    return _cleaned_up(task, node, server, [f"branch{i}" for i in range(branches)] +
                       [f"end{i}" for i in range(branches)])


TREES = {"attempt-with-rollback": attempt_with_rollback, "explore-and-commit": explore_and_commit}


def run_tree(root: py_trees.behaviour.Behaviour, period_s: float = 0.01, timeout_s: float = 120.0,
             setup_timeout_s: float = 30.0, shutdown: bool = True) -> Status:
    """Tick until the root finishes (or ``timeout_s``); returns its status. ``shutdown``: the
    tree is done with then (no retry will come), and behaviours let go of what they kept
    for one."""
    tree = py_trees.trees.BehaviourTree(root)
    # One discovery window shared by every behaviour (see _Call.setup), inside py_trees' own timeout.
    tree.setup(timeout=setup_timeout_s, deadline=time.monotonic() + min(5.0, setup_timeout_s / 2))
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            tree.tick()
            if root.status in (Status.SUCCESS, Status.FAILURE):
                return root.status
            time.sleep(period_s)
        root.stop(Status.INVALID)
        return Status.INVALID
    finally:
        if shutdown:   # every behaviour hears the tree is done (py_trees' shutdown)
            tree.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tree", choices=sorted(TREES))
    parser.add_argument("--server", default="/flashrt", help="the node's fully qualified name")
    parser.add_argument("--branches", type=int, default=3, help="explore-and-commit: branches")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    args, ros_args = parser.parse_known_args(argv)
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    rclpy.init(args=ros_args)
    node = rclpy.create_node("flashrt_bt_example")
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    # The tree's clients exist before anything spins the node: Kilted's rclpy (9.1.2)
    # registers an ActionClient with its node before the client has its lock, and an
    # executor iterating the node then fails on the half-built client.
    spinner = threading.Thread(target=executor.spin, daemon=True)
    try:
        extra = {"branches": args.branches} if args.tree == "explore-and-commit" else {}
        root = TREES[args.tree](node, server=args.server, **extra)
        spinner.start()
        status = run_tree(root, timeout_s=args.timeout)
        print(py_trees.display.unicode_tree(root, show_status=True))
        print(f"{args.tree}: {status.value}")
        return 0 if status == Status.SUCCESS else 1
    finally:
        # The spin thread must be out of rclpy's C++ wait before the interpreter exits
        # (a thread still inside it aborts the process at exit).
        executor.shutdown(timeout_sec=5)
        if spinner.ident is not None:
            spinner.join(5)
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
