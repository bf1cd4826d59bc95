"""flashrt-replay --live: a recording of a node's topics and service events, played over DDS into
the installed flashrt_node running in its own process, judged by what that node answers."""
from __future__ import annotations

import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("rclpy")
pytest.importorskip("rosbags")

from install_space import EXECUTABLES  # noqa: E402
from policy_recording import NODE, recorded_session, same_kernels_env, with_a_changed_action  # noqa: E402

NODE_EXECUTABLE = EXECUTABLES / "flashrt_node"
REPLAY = EXECUTABLES / "flashrt-replay"
pytestmark = pytest.mark.skipif(not NODE_EXECUTABLE.exists(), reason="needs the colcon install space (make test builds it)")


_THREADS: dict[str, str] = {}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    from flashrt_ros.replay.recording import find_session

    path = recorded_session(tmp_path_factory.mktemp("live") / "robot")
    # The recording node ran inside this test process, at whatever torch thread count the tests
    # before it left; the live node is started at that count, as the exact verdict requires.
    _THREADS["OMP_NUM_THREADS"] = str(find_session(path).torch_threads)
    return path


def _env() -> dict[str, str]:
    # Both processes: discovery on this host only, in this run's private domain.
    return {**same_kernels_env(), **_THREADS, "ROS_AUTOMATIC_DISCOVERY_RANGE": "LOCALHOST"}


@contextmanager
def _node(tmp_path: Path):
    """The installed node, started as the recorded one was (its defaults, max_seq_len 512)."""
    log = open(tmp_path / "node.log", "w+")
    proc = subprocess.Popen([str(NODE_EXECUTABLE), "--ros-args", "-p", "autostart:=true", "-p", "max_seq_len:=512",
                             "-p", "status_rate:=0.0"], stdout=log, stderr=subprocess.STDOUT, env=_env())
    try:
        yield log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _log(log) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-3000:]


def test_a_recording_played_into_the_live_node_is_judged_exact(recorded, tmp_path):
    with _node(tmp_path) as log:
        done = subprocess.run([str(REPLAY), str(recorded), "--live", "--timeout", "120"], capture_output=True,
                              text=True, timeout=300, env=_env())
        assert done.returncode == 0, done.stdout + done.stderr + _log(log)
    assert f"into the live node {NODE}" in done.stdout, done.stdout
    # Recorded and served by processes started alike on this machine: byte-identical.
    assert "verdict applied: exact" in done.stdout, done.stdout
    assert "exact:    identical: 17 operations, 0 tokens, 10 actions, 6 capsule calls, 1 refusals" in done.stdout, \
        done.stdout


def test_a_live_node_that_acts_otherwise_fails_and_an_absent_one_exits_2(recorded, tmp_path):
    changed = with_a_changed_action(recorded, tmp_path / "changed")
    with _node(tmp_path) as log:
        done = subprocess.run([str(REPLAY), str(changed), "--live", "--timeout", "120", "--verdict", "portable"],
                              capture_output=True, text=True, timeout=300, env=_env())
        assert done.returncode == 1, done.stdout + done.stderr + _log(log)
    assert "seq=" in done.stderr and "action: exact differs, portable differs" in done.stderr, done.stderr
    assert "portable: fail" in done.stderr, done.stderr

    gone = subprocess.run([str(REPLAY), str(recorded), "--live", "--timeout", "3"], capture_output=True, text=True,
                          timeout=60, env=_env())
    assert gone.returncode == 2 and "no session record" in gone.stderr, gone.stdout + gone.stderr
