"""A journal bag its recorder never closed (the node killed, the file cut short) replays up to its
last complete message, and says that the recording ends early."""
from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rosbags")

from flashrt_ros.replay.bag import any_reader, read_bag  # noqa: E402
from flashrt_ros.replay.cli import main as replay_main  # noqa: E402
from flashrt_ros.replay.salvage import complete_bag, unfinished  # noqa: E402
from install_space import EXECUTABLES, NodeClient, start_node  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "data" / "bags" / "attempt_with_rollback"
EXECUTABLE = EXECUTABLES / "flashrt_node"


def _verdicts(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(("exact:", "portable:", "verdict applied:"))]


def test_a_bag_that_lost_its_footer_replays_every_operation_as_the_whole_bag_does(tmp_path, capsys):
    cut = tmp_path / "cut"
    shutil.copytree(COMMITTED, cut)
    (mcap,) = cut.glob("*.mcap")
    mcap.write_bytes(mcap.read_bytes()[:-64])
    assert unfinished(cut) == "its MCAP file has no footer" and unfinished(COMMITTED) == ""
    whole = replay_main([str(COMMITTED)])
    whole_out = capsys.readouterr().out
    assert replay_main([str(cut)]) == whole == 0   # the verdict this machine applies (exact or portable) passes
    out, err = capsys.readouterr()
    assert "the recording ends early" in err
    assert _verdicts(out) == _verdicts(whole_out) and len(_verdicts(out)) == 3
    assert f"replaying {len(read_bag(COMMITTED).entries)} operations" in out
    assert mcap.stat().st_size == (next(COMMITTED.glob("*.mcap")).stat().st_size - 64)   # the folder is not changed


def test_a_bag_without_metadata_or_with_nothing_complete_is_named(tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(COMMITTED, bare)
    (bare / "metadata.yaml").unlink()
    assert replay_main([str(bare)]) == 0
    assert "no metadata.yaml" in capsys.readouterr().err
    (mcap,) = bare.glob("*.mcap")
    mcap.write_bytes(mcap.read_bytes()[:200])   # the header and the first schemas only
    assert replay_main([str(bare)]) == 2
    assert "no complete message is left" in capsys.readouterr().err


def test_a_bag_cut_anywhere_keeps_every_operation_written_in_full_before_the_cut(tmp_path):
    """A journal written as the node writes it (a chunk per operation), cut at many points: what
    is kept only grows as the cut moves later, and a cut never turns into an error past the
    first whole chunk."""
    from flashrt_ros.errors import InvalidArgument
    from flashrt_ros.replay import Journal
    from flashrt_ros.replay.bag import BagWriter
    from flashrt_ros.replay.salvage import salvage
    from flashrt_ros.replay.session import session_of
    from flashrt_ros.runtime import Engine, ModelConfig
    from flashrt_ros.serving.session import Session

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    journal = Journal(session=session_of(engine, "", 0))
    session = Session(engine, journal)
    writer = BagWriter(tmp_path / "whole", journal.session, flush_each=True)
    journal.listeners.append(writer)
    list(session.generate([256, 5, 9], 4))
    session.snapshot(name="s")
    session.rollback(steps=1)
    engine.close()
    (mcap,) = (tmp_path / "whole").glob("*.mcap")
    data = mcap.read_bytes()   # the writer is not closed: no summary, no footer, as after a kill
    total = 1 + len(journal.entries)
    kept = []
    for n, end in enumerate(range(0, len(data) + 1, 23)):
        cut = tmp_path / f"cut{n}"
        cut.mkdir()
        (cut / "cut.mcap").write_bytes(data[:end])
        try:
            done = salvage(cut, tmp_path / f"out{n}", "test")
            kept.append(done.messages)
            assert 0 <= done.dropped_bytes < end
        except InvalidArgument:
            assert not kept, f"nothing kept at {end} bytes after {kept[-1]} messages at fewer"
    assert kept == sorted(kept) and kept[-1] == total and len(set(kept)) > 5
    writer.close()


@pytest.mark.skipif(not EXECUTABLE.exists(), reason="needs the colcon install space (make test builds it)")
def test_the_journal_of_a_node_killed_mid_session_replays_up_to_the_kill(monkeypatch, tmp_path):
    pytest.importorskip("rclpy")
    from flashrt_ros.action import Generate
    from ros_harness import SERVICES, wait_future

    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    journal = tmp_path / "journal"
    log = open(tmp_path / "node.log", "w+")
    proc = start_node(log, "max_seq_len:=256", f"journal_path:={journal}")
    client = NodeClient("flashrt_crash_test", {k: SERVICES[k] for k in ("list_capsules", "snapshot", "rollback")})

    def generate(prompt):
        handle = wait_future(client.actions.send_goal_async(Generate.Goal(prompt=prompt, max_new_tokens=6)), 60)
        return wait_future(handle.get_result_async(), 60).result

    try:
        for c in client.clients.values():
            assert c.wait_for_service(timeout_sec=90), "node process did not come up"
        assert client.call("list_capsules", idempotent=True).success   # active, and the reply path matched
        assert client.call("snapshot", name="before").success
        assert client.actions.wait_for_server(timeout_sec=30)
        first = generate("the arm reached")
        assert first.success, first.message
        assert client.call("snapshot", name="mid").success
        assert client.call("rollback", steps=2, to_position=-1).success
        second = generate(" and then")
        assert second.success, second.message
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=15)
        client.close()
    (bag,) = journal.glob("session-*")
    assert unfinished(bag) == "no metadata.yaml"
    # In a process of its own, as a user runs it: it starts at the kernels the node recorded.
    done = subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", str(bag)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, out + err
    assert "the recording ends early (no metadata.yaml)" in err
    assert "exact:    identical" in out and "verdict applied: exact" in out, out + err
    # Every operation the node committed before the kill is in the bag: two snapshots, a
    # rollback, and two goals of a prompt and six tokens each.
    judged = int(out.split("replaying ")[1].split(" operations")[0])
    assert judged == 2 + 1 + 2 * (1 + 6)
    with complete_bag(bag) as (whole, _):   # and other tools read what was kept, service events included
        with any_reader(whole) as reader:
            types = {c.msgtype for c in reader.connections}
            assert all(reader.deserialize(raw, c.msgtype) is not None for c, _, raw in reader.messages())
    assert "flashrt_ros/srv/Snapshot_Event" in types
