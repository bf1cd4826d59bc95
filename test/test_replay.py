"""Journal bags: recorded by the node, replayed by flashrt-replay in a fresh process, tampering caught."""
from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("rclpy")
pytest.importorskip("rosbags")

from flashrt_ros.replay.bag import read_bag, write_bag  # noqa: E402
from flashrt_ros.replay.cli import main as replay_main  # noqa: E402
from flashrt_ros.replay.session import cpu_name  # noqa: E402
from flashrt_ros.serving.record import SessionRecord  # noqa: E402
from install_space import EXECUTABLES, PREFIX  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "data" / "bags" / "attempt_with_rollback"
REPLAY = EXECUTABLES / "flashrt-replay"


def _replay_process(*args: str) -> subprocess.CompletedProcess:
    """flashrt-replay in a process of its own: bags made from the committed one need its
    recorded CPU kernels, and only a new process can be started at them."""
    return subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=Path(args[0]).parent)   # not the source tree: the installed package


def _passes(done: subprocess.CompletedProcess, session: SessionRecord) -> None:
    """A replay of a bag from ``session`` passed its verdict: exact on the recording's platform
    (the same CPU vendor and model, and the recorded vector kernels, which the command steps
    down to), portable on any other, where the products round differently in their low bits."""
    assert done.returncode == 0, done.stdout + done.stderr
    recorded, here = session.cpu, cpu_name()
    if recorded == here and "platform: the recording's" in done.stdout:
        assert "exact:    identical" in done.stdout and "verdict applied: exact" in done.stdout, done.stdout
    else:
        assert "portable: pass" in done.stdout and "verdict applied: portable" in done.stdout, done.stdout


def _tampered(bag: Path, out: Path, kind: str = "step") -> int:
    """A copy of ``bag`` with one byte of the first ``kind`` entry's output changed; returns its seq."""
    journal = read_bag(bag)
    entry = next(e for e in journal.entries if e.kind == kind)
    if kind == "step":   # the sign of the first value: a real difference, whatever the verdict
        hexed = entry.outcome["action"]
        entry.outcome["action"] = hexed[:6] + format(int(hexed[6], 16) ^ 8, "x") + hexed[7:]
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
        assert f"recorded with torch {journal.session.torch}" in err, err
        assert err.count(cpu_name()) == 2, err   # recorded here, replayed here


def test_the_committed_bag_replays_with_the_installed_command(tmp_path):
    assert COMMITTED.is_dir() and sum(f.stat().st_size for f in COMMITTED.iterdir()) < 1 << 20
    # The whole attempt-with-rollback scenario, the plan's 8 tokens included.
    kinds = [e.kind for e in read_bag(COMMITTED).entries]
    assert kinds.count("decode") == 8 and {"prefill", "step", "snapshot", "rollback", "drop"} <= set(kinds)
    # Recorded at the kernels of every x86 machine: an AVX-512 one replays it by stepping down.
    assert read_bag(COMMITTED).session.aten_cpu_capability == "AVX2"
    if not REPLAY.exists():
        pytest.skip("needs the colcon install space (make test builds it)")
    ok = subprocess.run([str(REPLAY), str(COMMITTED)], capture_output=True, text=True, timeout=120)
    _passes(ok, read_bag(COMMITTED).session)
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


def _session(ros_context, tmp_path, params: dict, work) -> Path:
    """Run ``work(harness)`` on a node journaling into tmp_path; return the bag."""
    import sys

    sys.path.insert(0, str(ROOT / "test"))
    from ros_harness import Harness

    h = Harness(ros_context, {"journal_path": str(tmp_path / "journal"), **params})
    try:
        work(h)
        h.node.trigger_deactivate()
        h.node.trigger_cleanup()
    finally:
        h.close()
    return next((tmp_path / "journal").glob("session-*"))


def test_refused_request_ids_and_a_spill_switch_replay_identically(ros_context, tmp_path):
    """Refusals the node makes from its own state (a request_id reused with other fields, or
    retried after its capsule was dropped)
    and from parameters changed at run time (spill off) must come out the same on replay."""
    from rclpy.parameter import Parameter
    from ros_harness import wait_future

    from flashrt_ros.msg import ErrorCode

    def work(h):
        _, result = h.generate(token_ids=list(range(1, 20)), max_new_tokens=2)
        assert wait_future(result).result.success
        assert not h.call("snapshot", request_id="x" * 300).success
        assert h.call("snapshot", name="s", request_id="r1").success
        assert not h.call("snapshot", name="other", request_id="r1").success
        first = h.call("snapshot", request_id="r2")
        assert h.call("drop_capsule", capsule_id=first.capsule_id).success
        gone = h.call("snapshot", request_id="r2")   # a retry of a snapshot since dropped
        assert not gone.success and gone.error_code == ErrorCode.UNKNOWN_CAPSULE
        huge = h.call("snapshot", tier="x" * 200_000)   # cut in messages and in the journal
        assert huge.error_code == ErrorCode.INVALID_ARGUMENT and len(huge.message) < 200
        assert h.node.set_parameters([Parameter("spill", value=False)])[0].successful
        refused = next(r for r in (h.call("snapshot") for _ in range(64)) if not r.success)
        assert "spill is off" in refused.message

    bag = _session(ros_context, tmp_path, {"budgets.device_mb": 1}, work)
    entries = read_bag(bag).entries
    assert [e.kind for e in entries].count("spill") == 1
    assert max(len(v) for e in entries for v in e.request.values() if isinstance(v, str)) <= 1024
    assert replay_main([str(bag)]) == 0


def test_a_speculative_session_with_an_mtp_head_replays_given_the_same_head(ros_context, tmp_path):
    """Its tokens are journaled one entry each and replay as plain decode steps, exactly; the
    head file is not recorded (the fingerprint covers its weights), so replay asks for it."""
    from ros_harness import wait_future

    from flashrt_ros.runtime import ModelConfig, mtp_head
    from flashrt_ros.runtime.weights import seeded_weights

    head = tmp_path / "head.safetensors"
    cfg = ModelConfig.tiny(obs_dim=23, action_dim=7)
    mtp_head.save(head, {n: t for n, t in seeded_weights(cfg, 5).items() if n.startswith("mtp.")}, {})

    def work(h):
        _, result = h.generate(token_ids=list(range(1, 20)), max_new_tokens=30)   # the node's speculative=3
        assert wait_future(result).result.success
        assert h.call("snapshot", name="mid").success
        assert h.call("rollback", steps=4).success
        _, result = h.generate(max_new_tokens=12, speculative=2)
        assert wait_future(result).result.success
        assert h.node.engine.speculation_stats.passes > 0

    bag = _session(ros_context, tmp_path, {"mtp_head": str(head), "speculative": 3}, work)
    assert replay_main([str(bag)]) == 2   # the seeded head: another model fingerprint
    assert replay_main([str(bag), "--mtp-head", str(head)]) == 0


def test_a_journal_that_cannot_write_stops_and_changes_no_answer(ros_context, tmp_path):
    import errno

    from ros_harness import wait_future

    def work(h):
        _, result = h.generate(token_ids=list(range(1, 20)), max_new_tokens=0)
        assert wait_future(result).result.success

        def disk_full(entry):
            raise OSError(errno.ENOSPC, "No space left on device")
        h.node.session.journal.listeners.append(disk_full)
        made = h.call("snapshot", name="s1")
        assert made.success, made.message
        assert h.node.session.journal is None
        assert h.call("snapshot", name="s1").error_code == 2   # INVALID_ARGUMENT: the name is taken
        _, result = h.generate(max_new_tokens=3)
        assert wait_future(result).result.success

    _session(ros_context, tmp_path, {}, work)


def test_cleanup_frees_the_engine_even_when_the_journal_folder_is_gone(ros_context, tmp_path):
    from ros_harness import wait_future

    def work(h):
        _, result = h.generate(token_ids=list(range(1, 20)), max_new_tokens=0)
        assert wait_future(result).result.success
        for folder in (tmp_path / "journal").glob("session-*"):
            shutil.rmtree(folder)
        h.node.trigger_deactivate()
        h.node.trigger_cleanup()
        assert h.node.engine is None and h.node.label == "unconfigured"
        h.node.trigger_configure()
        h.node.trigger_activate()
        assert h.call("snapshot").success

    _session(ros_context, tmp_path, {}, work)


def test_a_bag_with_a_malformed_entry_exits_2(tmp_path):
    journal = read_bag(COMMITTED)
    drop = next(e for e in journal.entries if e.kind == "drop")
    drop.request.clear()   # no capsule_id
    write_bag(tmp_path / "malformed", journal)
    done = _replay_process(str(tmp_path / "malformed"))
    assert done.returncode == 2 and "malformed entry" in done.stderr, done.stdout + done.stderr


def test_a_session_that_restores_a_capsule_found_on_disk_at_start_replays(ros_context, tmp_path):
    """The second configure loads the first session's disk capsule: replay copies it from
    capsule_dir (or --capsule-dir), and says what is missing when it is gone."""
    from ros_harness import wait_future

    capsules = tmp_path / "capsules"

    def work(h):
        _, result = h.generate(token_ids=list(range(1, 20)), max_new_tokens=2)
        assert wait_future(result).result.success
        assert h.call("snapshot", name="keep", tier="disk").success
        h.node.trigger_deactivate()
        h.node.trigger_cleanup()        # session 1 ends; session 2 starts from the file
        h.node.trigger_configure()
        h.node.trigger_activate()
        assert h.call("restore", capsule_id="keep").success
        _, result = h.generate(max_new_tokens=2)
        assert wait_future(result).result.success

    _session(ros_context, tmp_path, {"capsule_dir": str(capsules)}, work)
    second = sorted((tmp_path / "journal").glob("session-*"))[-1]
    assert [i for i, _ in read_bag(second).session.preloaded] == [p.stem for p in capsules.glob("*.capsule")]
    assert replay_main([str(second)]) == 0
    moved = tmp_path / "moved"
    shutil.move(capsules, moved)
    assert replay_main([str(second)]) == 2
    assert replay_main([str(second), "--capsule-dir", str(moved)]) == 0


def test_damaged_bags_and_impossible_sessions_exit_2_with_a_reason(tmp_path, capsys):
    truncated = tmp_path / "truncated"
    shutil.copytree(COMMITTED, truncated)
    mcap = next(truncated.glob("*.mcap"))
    # Cut inside its first message: nothing whole is left for salvage to read (a bag cut later
    # replays up to its last whole message: test_replay_after_crash).
    mcap.write_bytes(mcap.read_bytes()[:200])
    garbled = tmp_path / "garbled"
    shutil.copytree(COMMITTED, garbled)
    (garbled / "metadata.yaml").write_text("{[: not yaml")
    journal = read_bag(COMMITTED)
    journal.session = replace(journal.session, torch_threads=0)
    write_bag(tmp_path / "threads", journal)
    journal = read_bag(COMMITTED)
    journal.session = replace(journal.session, version=99)
    write_bag(tmp_path / "version", journal)
    for bag in (truncated, garbled, tmp_path / "threads", tmp_path / "version"):
        assert replay_main([str(bag)]) == 2
        assert "cannot replay" in capsys.readouterr().err


@pytest.mark.parametrize("kind, key", [("decode", "token"), ("snapshot", "state_digest"), ("step", "action")])
def test_an_entry_without_the_outputs_it_must_have_recorded_is_refused_not_called_identical(tmp_path, kind, key):
    journal = read_bag(COMMITTED)
    entry = next(e for e in journal.entries if e.kind == kind)
    del entry.outcome[key]
    write_bag(tmp_path / "gutted", journal)
    done = _replay_process(str(tmp_path / "gutted"))
    assert done.returncode == 2 and f"seq={entry.seq} ({kind}) records no {key}" in done.stderr, done.stderr


def test_a_bag_whose_wall_clock_stepped_back_replays_in_the_order_of_its_entries(tmp_path, monkeypatch):
    import flashrt_ros.replay.bag as bag_module

    stamps = iter(range(10**12, 0, -10**6))   # every message stamped before the one written ahead of it
    monkeypatch.setattr(bag_module.time, "time_ns", lambda: next(stamps))
    write_bag(tmp_path / "backwards", read_bag(COMMITTED))
    monkeypatch.undo()
    assert [e.seq for e in read_bag(tmp_path / "backwards").entries] == list(range(len(read_bag(COMMITTED).entries)))
    _passes(_replay_process(str(tmp_path / "backwards")), read_bag(COMMITTED).session)


@pytest.mark.parametrize("recorded, here, restarts", [
    ("AVX2", "AVX512", True), ("DEFAULT", "AVX2", True),
    ("AVX512", "AVX2", False),   # torch would take the variable on trust and crash on the missing kernels
    ("AVX2", "AVX2", False), ("SVE256", "AVX2", False), (None, "AVX512", False)])
def test_the_command_restarts_only_to_step_down_to_the_recorded_kernels(monkeypatch, recorded, here, restarts):
    import os
    import platform

    from flashrt_ros.replay import cli

    if os.name != "posix" or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the restart is for x86 only")
    calls = []
    monkeypatch.delenv(cli.CAPABILITY_ENV, raising=False)
    monkeypatch.setattr(cli.torch.backends.cpu, "get_cpu_capability", lambda: here)
    monkeypatch.setattr(cli.os, "execve", lambda path, args, env: calls.append(env[cli.CAPABILITY_ENV]))
    cli._rerun_at(recorded)
    assert calls == ([recorded.lower()] if restarts else [])
    monkeypatch.setenv(cli.CAPABILITY_ENV, "avx2")   # set already (the restarted process): never again
    cli._rerun_at(recorded)
    assert len(calls) == int(restarts)


def test_the_committed_bag_under_other_vector_kernels_fails_exact_and_passes_portable(tmp_path):
    """A platform change in a new process: torch's DEFAULT (scalar) kernels round the products
    differently from the recorded AVX2 ones, as another CPU vendor's would."""
    import os
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("ATEN_CPU_CAPABILITY's levels are x86 ones")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", str(COMMITTED), *args],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)

    exact = run("--verdict", "exact")
    assert exact.returncode == 1 and "MISMATCH" in exact.stderr and "exact:    differs" in exact.stderr, exact.stderr
    assert "state_digest: exact differs, portable exact-only" in exact.stderr, exact.stderr
    auto = run("--report", str(tmp_path / "verdicts.tsv"))
    assert auto.returncode == 0 and "aten_cpu_capability 'AVX2' when recorded, 'DEFAULT' here" in auto.stdout, auto
    assert "portable: pass" in auto.stdout and "verdict applied: portable" in auto.stdout, auto.stdout
    rows = [line.split("\t") for line in (tmp_path / "verdicts.tsv").read_text().splitlines()[1:]]
    assert len(rows) == len(read_bag(COMMITTED).entries) and all(r[3] == "pass" for r in rows)
    assert any(r[2] == "differs" for r in rows) and any(r[2] == "identical" for r in rows)


def _fields(definition: str) -> list[str]:
    """A message definition's lines without comments or blank lines."""
    lines = (line.split("#", 1)[0].rstrip() for line in definition.splitlines())
    return [line for line in lines if line]


def test_every_topic_of_a_journal_bag_has_its_real_type_for_rosbags_and_mcap():
    """The bag as other tools see it: rosbag2's layout, an indexed MCAP whose schemas alone
    decode every message (as Foxglove would, without this package's types)."""
    from mcap.reader import make_reader
    from rosbags.rosbag2 import Reader
    from rosbags.typesys import Stores, get_typestore, get_types_from_msg

    from flashrt_ros.replay.types import schema_text

    expected = {"/flashrt/journal/session": "flashrt_ros/msg/JournalSession",
                "/flashrt/journal": "flashrt_ros/msg/JournalEntry",
                "/flashrt/joint_states": "sensor_msgs/msg/JointState",
                "/flashrt/ee_pose": "geometry_msgs/msg/PoseStamped",
                "/flashrt/action": "trajectory_msgs/msg/JointTrajectoryPoint",
                "/flashrt/events": "flashrt_ros/msg/CapsuleEvent",
                "/flashrt/generate/goal": "flashrt_ros/action/Generate_Goal",
                "/flashrt/generate/result": "flashrt_ros/action/Generate_Result",
                "/flashrt/snapshot/_service_event": "flashrt_ros/srv/Snapshot_Event",
                "/flashrt/rollback/_service_event": "flashrt_ros/srv/Rollback_Event",
                "/flashrt/drop_capsule/_service_event": "flashrt_ros/srv/DropCapsule_Event"}
    (path,) = COMMITTED.glob("*.mcap")
    with path.open("rb") as f:
        summary = make_reader(f).get_summary()
    assert summary.chunk_indexes, "an MCAP without its index"
    by_mcap = {c.topic: summary.schemas[c.schema_id].name for c in summary.channels.values()}
    assert by_mcap == expected
    assert {summary.schemas[c.schema_id].encoding for c in summary.channels.values()} == {"ros2msg"}

    from importlib import import_module

    from rclpy.serialization import deserialize_message

    def ros_type(name: str):
        """The generated class of a type name as a bag gives it (``pkg/srv/Foo_Event`` included)."""
        package, kind, leaf = name.split("/")
        if kind in ("srv", "action"):   # Foo_Event is Foo.Event, Generate_Goal Generate.Goal
            interface, part = leaf.rsplit("_", 1)
            return getattr(getattr(import_module(f"{package}.{kind}"), interface), part)
        return getattr(import_module(f"{package}.{kind}"), leaf)

    store = get_typestore(Stores.ROS2_JAZZY)   # the standard types only: ours come from the bag
    with Reader(COMMITTED) as reader:
        assert {c.topic: c.msgtype for c in reader.connections} == expected
        for c in reader.connections:   # every message schema parses on its own; a service
            if c.msgtype.endswith("_Event"):   # event's is its .srv file, as rosbag2 writes it
                # Its fields, not its comments: the bag was recorded on Jazzy, whose interface
                # files (builtin_interfaces/Time's, say) carry other comments than Kilted's.
                assert _fields(c.msgdef.data) == _fields(schema_text(c.msgtype))
                assert c.msgdef.data.startswith("=" * 80 + f"\nSRV: {c.msgtype[:-len('_Event')]}\n")
                continue
            store.register(get_types_from_msg(c.msgdef.data, c.msgtype))
        decoded = {}
        for c, _, raw in reader.messages():   # ROS itself reads every message, and so does rosbags
            decoded.setdefault(c.topic, []).append(deserialize_message(bytes(raw), ros_type(c.msgtype)))
            if not c.msgtype.endswith("_Event"):
                store.deserialize_cdr(raw, c.msgtype)   # (it refuses bytes after the fields)
    assert len(decoded["/flashrt/joint_states"]) == len(decoded["/flashrt/action"]) == 12
    events = decoded["/flashrt/snapshot/_service_event"]
    assert [e.info.event_type for e in events] == [1, 2]   # REQUEST_RECEIVED, RESPONSE_SENT
    assert events[1].response[0].success and events[1].response[0].capsule_id
    assert [e.kind for e in decoded["/flashrt/journal"]][:2] == ["prefill", "decode"]
    assert list(decoded["/flashrt/generate/result"][0].tokens) == [
        e.outcome["token"] for e in read_bag(COMMITTED).entries if e.kind == "decode"]


def test_a_journal_recorded_in_process_is_written_as_a_bag_and_replays(tmp_path):
    """A session the session layer ran without a node (make bench's replay section records one)
    has no node fields: its bag carries them empty, and replays."""
    from flashrt_ros.replay import Journal
    from flashrt_ros.replay.session import session_of
    from flashrt_ros.runtime import Engine, ModelConfig
    from flashrt_ros.serving.session import Session

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=128)
    session = Session(engine, Journal(session=session_of(engine, "", 0)))
    list(session.generate([256, 5, 9], 6, speculative=2))
    session.snapshot(name="s")
    session.rollback(steps=2)
    bag = write_bag(tmp_path / "bag", session.journal)
    assert [e.kind for e in read_bag(bag).entries] == [e.kind for e in session.journal.entries]
    assert replay_main([str(bag)]) == 0


def test_rosbags_any_reader_opens_every_bag_the_package_ships_or_writes(tmp_path):
    """rosbags' high-level reader, as docs/ros.md shows it: every message of every bag decodes.
    Plain AnyReader refuses a bag with service events (rosbag2's own too): it cannot parse the
    service definition rosbag2 stores for them; a bag without them it opens as it is."""
    from rosbags.highlevel import AnyReader
    from rosbags.highlevel.anyreader import AnyReaderError

    from flashrt_ros.replay import Journal
    from flashrt_ros.replay.bag import any_reader
    from flashrt_ros.replay.salvage import complete_bag
    from flashrt_ros.replay.session import session_of
    from flashrt_ros.runtime import Engine, ModelConfig
    from flashrt_ros.serving.session import Session

    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    session = Session(engine, Journal(session=session_of(engine, "", 0)))
    list(session.generate([256, 5, 9], 3))
    session.snapshot(name="s")
    in_process = write_bag(tmp_path / "in_process", session.journal)
    engine.close()
    cut = tmp_path / "cut"
    shutil.copytree(COMMITTED, cut)
    (mcap,) = cut.glob("*.mcap")
    mcap.write_bytes(mcap.read_bytes()[:-64])
    with complete_bag(cut) as (salvaged, _):
        for bag, messages in ((COMMITTED, 63), (in_process, 1 + len(session.journal.entries)), (salvaged, 63)):
            with any_reader(bag) as reader:
                decoded = [reader.deserialize(raw, c.msgtype) for c, _, raw in reader.messages()]
            assert len(decoded) == messages, bag
    with AnyReader([in_process]) as reader:
        assert sum(1 for _ in reader.messages()) == 1 + len(session.journal.entries)
    # Deliberately pinned to rosbags 0.11.9's behaviour: a release that parses a SRV section
    # fails this line, and docs/ros.md's recipe can then give way to plain AnyReader.
    with pytest.raises(AnyReaderError, match="Could not parse"):
        with AnyReader([COMMITTED]):
            pass


def test_a_service_event_is_named_with_the_hash_ros_gives_it():
    """The RIHS01 hash each topic's type carries is rosidl's, as the build's type descriptions
    record it (the service events' included, whose request and response rosbags would file
    under another name)."""
    import json

    from flashrt_ros.replay.types import type_hash, typestore

    descriptions = PREFIX / "share" / "flashrt_ros"
    if not descriptions.exists():
        pytest.skip("needs the colcon install space (make test builds it)")
    checked = set()
    for path in [*descriptions.glob("srv/*.json"), *descriptions.glob("msg/*.json"), *descriptions.glob("action/*.json")]:
        for entry in json.loads(path.read_text())["type_hashes"]:
            if entry["type_name"] in typestore().types:   # the types a bag can hold, not a service as a whole
                assert type_hash(entry["type_name"]) == entry["hash_string"], entry["type_name"]
                checked.add(entry["type_name"])
    services = {p.stem for p in descriptions.glob("srv/*.srv")}
    assert {f"flashrt_ros/srv/{s}_Event" for s in services} <= checked
    assert "service_msgs/msg/ServiceEventInfo" in checked and "flashrt_ros/msg/JournalEntry" in checked
