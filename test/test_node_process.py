"""flashrt_node from install/ as its own process, driven from this one over DDS."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from install_space import EXECUTABLES, NodeClient, start_node  # noqa: E402
from ros_harness import SERVICES, wait_future  # noqa: E402

EXECUTABLE = EXECUTABLES / "flashrt_node"


@pytest.mark.skipif(not EXECUTABLE.exists(), reason="needs the colcon install space (make test builds it)")
def test_installed_node_serves_another_process_and_stops_on_sigterm(monkeypatch, tmp_path):
    from flashrt_ros.action import Generate

    # Both processes: discovery on this host only, in this run's private domain.
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    log = open(tmp_path / "node.log", "w+")
    proc = start_node(log, "max_seq_len:=512", f"capsule_dir:={tmp_path / 'capsules'}")
    client = NodeClient("flashrt_process_test", SERVICES)
    call, actions = client.call, client.actions
    try:
        for c in client.clients.values():
            assert c.wait_for_service(timeout_sec=90), "node process did not come up:\n" + _tail(log)

        assert call("list_capsules", idempotent=True).success   # active, and the reply path matched
        assert actions.wait_for_server(timeout_sec=30)
        handle = wait_future(actions.send_goal_async(Generate.Goal(prompt="hello", max_new_tokens=4)))
        result = wait_future(handle.get_result_async()).result
        assert result.success and len(result.tokens) >= 1 and result.ttft_ms > 0
        snap = call("snapshot", name="proc", tier="disk", request_id="p1")
        assert snap.success, snap.message
        assert call("snapshot", name="proc", tier="disk", request_id="p1").capsule_id == snap.capsule_id
        assert call("fork", source_id=snap.capsule_id).success
        assert call("rollback", steps=1, to_position=-1).success
        assert call("restore", capsule_id=snap.capsule_id, verify=True).position == snap.position
        assert call("restore", capsule_id="nope").error_code == ErrorCode.UNKNOWN_CAPSULE
        assert len(call("list_capsules").capsules) == 2
        assert call("drop_capsule", capsule_id=snap.capsule_id).success

        # The example trees, one command each, against this live node.
        for tree in (["attempt-with-rollback"], ["explore-and-commit", "--branches", "2"]):
            run = subprocess.run([sys.executable, "-m", "flashrt_ros.bt.examples", *tree], capture_output=True,
                                 text=True, timeout=120, env=dict(os.environ))
            assert run.returncode == 0 and f"{tree[0]}: SUCCESS" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]

        # Digests still queued at the SIGTERM: the engine's close finishes them after the
        # context is gone, and each announcement printed a traceback.
        for _ in range(6):
            assert call("snapshot").success
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        took = time.monotonic() - started
        output = _tail(log)
        assert code == 0, output
        assert took < 10, f"SIGTERM took {took:.1f} s"
        assert "Traceback" not in output, output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()


def _tail(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-4000:]
