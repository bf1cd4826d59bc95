"""Many clients at once: every call answered, nothing raised inside the node, and the
final state equal to the same operations applied one after another."""
from __future__ import annotations

import random
import threading
import time

import pytest

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from flashrt_ros.replay import Journal, replay  # noqa: E402
from ros_harness import Harness, wait_future  # noqa: E402
from test_node_policy_params import _joint_state, _pose  # noqa: E402


def test_storm_of_clients_equals_its_sequential_replay(ros_context):
    from flashrt_ros.runtime import Engine, ModelConfig

    h = Harness(ros_context, {"rollback_depth": 4})
    h.node.session.journal = journal = Journal()
    try:
        _, result = h.generate(prompt="task context: sort the parts by colour", max_new_tokens=4)
        assert wait_future(result).result.success
        base = h.call("snapshot", name="base", pin=True)
        capsules, answers, failures = [base.capsule_id], [], []

        def service_client(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(25):
                    op = rng.choice(["snapshot", "restore", "fork", "rollback", "rollback_to", "list", "drop"])
                    if op == "snapshot":
                        r = h.call("snapshot", tier=rng.choice(["device", "host"]))
                        if r.success:
                            capsules.append(r.capsule_id)
                    elif op == "restore":
                        r = h.call("restore", capsule_id=rng.choice(capsules), verify=rng.random() < 0.3)
                    elif op == "fork":
                        r = h.call("fork", source_id=rng.choice(capsules + [""]))
                        if r.success:
                            capsules.append(r.capsule_id)
                    elif op == "rollback":
                        r = h.call("rollback", steps=rng.randint(0, 5), to_position=-1)
                    elif op == "rollback_to":
                        r = h.call("rollback", steps=0, to_position=rng.randint(0, 60))
                    elif op == "list":
                        r = h.call("list_capsules")
                    else:
                        victim = rng.choice(capsules[1:] or ["base-is-pinned-and-kept"])
                        r = h.call("drop_capsule", capsule_id=victim)
                    answers.append((op, r.error_code))
            except Exception as exc:  # collected: a thread's failure must fail the test
                failures.append(exc)

        def generator() -> None:
            try:
                for prompt in ("pick", "place"):
                    _, res = h.generate(prompt=prompt, max_new_tokens=20)
                    answers.append(("generate", wait_future(res, 120).result.error_code))
            except Exception as exc:
                failures.append(exc)

        def policy() -> None:
            try:
                joints, poses = h.policy_publishers()
                time.sleep(0.2)
                poses.publish(_pose())
                time.sleep(0.2)
                for i in range(20):
                    joints.publish(_joint_state([0.05 * i] * 7, velocities=[0.01 * i] * 7))
                    time.sleep(0.02)
            except Exception as exc:
                failures.append(exc)

        threads = [threading.Thread(target=service_client, args=(s,)) for s in range(3)]
        threads += [threading.Thread(target=generator), threading.Thread(target=policy)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        time.sleep(0.5)  # the last policy messages
        assert not failures, failures
        assert len(answers) == 3 * 25 + 2
        assert all(code != ErrorCode.INTERNAL for _, code in answers), answers
        assert h.node.report.counters["policy_steps"] > 0
        kinds = {e.kind for e in journal.entries}
        assert {"prefill", "decode", "step", "snapshot", "restore"} <= kinds, kinds

        # The same operations, one after another, on a fresh engine.
        with h.node.engine.lock:
            final = h.node.engine.state_digest()
            entries = list(journal.entries)
        fresh = Engine.from_config(ModelConfig.tiny(obs_dim=23, action_dim=7), max_seq_len=512, rollback_depth=4)
        report = replay(entries, fresh)
        assert report.entries == len(entries) and report.tokens > 0 and report.actions > 0
        assert report.capsule_calls >= 30
        # A goal finishes, or a restore or rollback between two of its tokens stops it.
        goals = [c for op, c in answers if op == "generate"]
        assert len(goals) == 2 and set(goals) <= {ErrorCode.OK, ErrorCode.PREEMPTED}, goals
        assert fresh.state_digest() == final
    finally:
        h.close()
