"""make demo's scenario end to end: the node as its own process, driven over DDS."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("rclpy")
pytest.importorskip("matplotlib")

from install_space import PREFIX  # noqa: E402


@pytest.mark.skipif(not PREFIX.is_dir(), reason="needs the colcon install space")
def test_demo_runs_every_step_and_writes_its_pictures(tmp_path):
    env = dict(os.environ)
    env.pop("ROS_AUTOMATIC_DISCOVERY_RANGE", None)  # the demo sets LOCALHOST for both of its processes
    run = subprocess.run([sys.executable, "-m", "flashrt_ros.demo", "--out", str(tmp_path)], capture_output=True,
                         text=True, timeout=1200, env=env)
    (tmp_path / "demo.log").write_text(run.stdout + run.stderr)   # beside its pictures: what it printed
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "demo OK" in run.stdout and "FAILED" not in run.stdout
    assert "faster" in run.stdout and "tokens/s" in run.stdout
    assert "retry success over N=20 episodes" in run.stdout and "over ROS, the tree: SUCCESS" in run.stdout
    assert "resume after an urgent request, N=50" in run.stdout and "agent resume on data/spec_tiny" in run.stdout
    assert "(a) full restore, the tree's snapshot" in run.stdout and "flashrt-replay exit 0 (exact), 0" in run.stdout
    assert "the same routes, never interrupted" in run.stdout
    # How many periods the loop lost is the machine's business; that the demo says it is the test's.
    lost = re.search(r"the simulation, at the end: .* (\d+) states stepped unanswered and (\d+) commands refused",
                     run.stdout)
    assert lost
    # A loop that lost no period and refused no command is the in-process loop over DDS (and the
    # tree judges by the simulation's time): every episode never interrupted ends as in process.
    alike = re.search(r"never interrupted, episode by episode: (\d+) of (\d+) as in process", run.stdout)
    assert alike and int(alike[2]) == 50
    if lost[1] == lost[2] == "0":
        assert alike[1] == alike[2], alike[0]
    for picture in ("timeline.png", "ttft.png", "retry_paths.png", "resume_ablation.png", "agent_resume.png"):
        data = (tmp_path / picture).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
