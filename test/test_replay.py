"""Journal bags: recorded by the node, replayed by flashrt-replay in a fresh process, tampering caught."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("rclpy")
pytest.importorskip("rosbags")

from flashrt_ros.replay.bag import read_bag, write_bag  # noqa: E402
from flashrt_ros.replay.cli import main as replay_main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "data" / "bags" / "attempt_with_rollback"
REPLAY = ROOT / "install" / "flashrt_ros" / "lib" / "flashrt_ros" / "flashrt-replay"


def _tampered(bag: Path, out: Path, kind: str = "step") -> int:
    """A copy of ``bag`` with one byte of the first ``kind`` entry's output changed; returns its seq."""
    journal = read_bag(bag)
    entry = next(e for e in journal.entries if e.kind == kind)
    if kind == "step":
        hexed = entry.outcome["action"]
        entry.outcome["action"] = ("0" if hexed[0] != "0" else "1") + hexed[1:]
    else:
        entry.outcome["token"] = (entry.outcome["token"] + 1) % 256
    write_bag(out, journal)
    return entry.seq


def test_a_recorded_session_with_capsule_calls_replays_identically_and_tampering_is_named(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(ROOT / "test"))
    from make_example_bag import record

    bag = record(tmp_path / "journal", trees=("attempt-with-rollback", "explore-and-commit"))
    journal = read_bag(bag)
    kinds = {e.kind for e in journal.entries}
    assert {"prefill", "decode", "step", "snapshot", "rollback", "fork", "restore", "drop"} <= kinds, kinds
    assert all("state_digest" in e.outcome for e in journal.entries if e.kind in ("snapshot", "restore", "rollback"))
    assert replay_main([str(bag)]) == 0
    assert "identical" in capsys.readouterr().out

    for kind in ("step", "decode"):
        seq = _tampered(bag, tmp_path / f"tampered-{kind}", kind)
        assert replay_main([str(tmp_path / f"tampered-{kind}")]) == 1
        err = capsys.readouterr().err
        assert f"seq={seq} ({kind})" in err, err
        assert f"recorded with torch {journal.session['torch']}" in err, err


def test_the_committed_bag_replays_with_the_installed_command(tmp_path):
    assert COMMITTED.is_dir() and sum(f.stat().st_size for f in COMMITTED.iterdir()) < 1 << 20
    # The whole attempt-with-rollback scenario, the plan's 8 tokens included.
    kinds = [e.kind for e in read_bag(COMMITTED).entries]
    assert kinds.count("decode") == 8 and {"prefill", "step", "snapshot", "rollback", "drop"} <= set(kinds)
    if not REPLAY.exists():
        pytest.skip("needs the colcon install space (make test builds it)")
    ok = subprocess.run([str(REPLAY), str(COMMITTED)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "identical" in ok.stdout
    seq = _tampered(COMMITTED, tmp_path / "tampered")
    bad = subprocess.run([str(REPLAY), str(tmp_path / "tampered")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and f"seq={seq} (step)" in bad.stderr, bad.stdout + bad.stderr


def test_unreadable_bags_exit_2(tmp_path):
    assert replay_main([str(tmp_path / "missing")]) == 2
    not_ours = tmp_path / "not_ours"
    shutil.copytree(COMMITTED, not_ours)
    meta = not_ours / "metadata.yaml"
    meta.write_text(meta.read_text().replace("/flashrt/journal/session", "/other/topic"))
    assert replay_main([str(not_ours)]) == 2
