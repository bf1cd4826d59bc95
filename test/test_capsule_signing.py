"""Capsule files signed with an optional key: without a valid signature they are refused
(UNTRUSTED_CAPSULE) at start and on restore, and the live state is untouched."""
from __future__ import annotations

import os
import threading

import pytest

from flashrt_ros.capsule import CapsuleError, diskformat, signing
from flashrt_ros.errors import ErrorCode, InvalidArgument
from flashrt_ros.runtime import Engine, ModelConfig

KEY = b"k" * 32
OTHER = b"o" * 32


def _engine(folder, key=None) -> Engine:
    return Engine.from_config(ModelConfig.tiny(), max_seq_len=64, capsule_dir=folder, capsule_key=key)


def _forge_history(path) -> None:
    """Rewrite the boundary log with every digest recomputed, as anyone can without the key."""
    header, data = diskformat.read(path)
    for key in ("version", "header_digest", signing.FIELD):
        header.pop(key, None)
    header["log"] = [["prefill", 0, 2], ["prefill", 2, header["position"] - 2]]
    diskformat.write(path, header, data)


def test_a_signed_capsule_loads_and_restores_with_its_key_and_is_skipped_with_another(tmp_path, caplog):
    engine = _engine(tmp_path, KEY)
    engine.prefill([1, 2, 3, 4, 5])
    capsule = engine.snapshot("signed", tier="disk")
    engine.close()
    header, _ = diskformat.read(diskformat.path_for(tmp_path, capsule.id), key=KEY)
    assert len(header[signing.FIELD]) == 64
    same = _engine(tmp_path, KEY)
    same.restore(capsule.id)
    assert same.state_digest() == capsule.digest
    same.close()
    assert _engine(tmp_path, OTHER).capsules.list() == []
    assert "signature does not match" in caplog.text
    # Without a key the digests alone are checked: the file still loads.
    assert [c.id for c in _engine(tmp_path).capsules.list()] == [capsule.id]


def test_an_unsigned_capsule_is_skipped_by_an_engine_with_a_key(tmp_path, caplog):
    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3])
    engine.snapshot("plain", tier="disk")
    engine.close()
    assert _engine(tmp_path, KEY).capsules.list() == []
    assert "is not signed" in caplog.text


def test_a_forged_history_is_refused_on_restore_and_at_start_with_untrusted_capsule(tmp_path, caplog):
    engine = _engine(tmp_path, KEY)
    engine.prefill([1, 2, 3, 4, 5, 6])
    capsule = engine.snapshot("task", tier="disk")
    engine.generate(2)
    live = engine.state_digest()
    _forge_history(diskformat.path_for(tmp_path, capsule.id))
    with pytest.raises(CapsuleError) as refused:
        engine.restore(capsule.id)
    assert refused.value.code == ErrorCode.UNTRUSTED_CAPSULE and engine.state_digest() == live
    engine.close()
    assert _engine(tmp_path, KEY).capsules.list() == []
    assert "not signed" in caplog.text
    # Without a key the forgery is a capsule of its own to the next start: what the digest cannot tell.
    assert [c.id for c in _engine(tmp_path).capsules.list()] == [capsule.id]


def test_a_key_file_is_read_whole_and_a_short_or_missing_one_is_refused(tmp_path):
    good = tmp_path / "key"
    good.write_bytes(KEY + b"\n")
    assert signing.load_key(good) == KEY
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(InvalidArgument, match="holds 3 bytes"):
        signing.load_key(tmp_path / "short")
    with pytest.raises(InvalidArgument, match="No such file"):
        signing.load_key(tmp_path / "absent")
    with pytest.raises(InvalidArgument, match="capsule_key must be"):
        _engine(tmp_path, "a string key")


def test_a_key_file_that_is_a_fifo_or_a_folder_is_refused_at_once(tmp_path):
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    refused = _in_thread(lambda: signing.load_key(fifo))
    assert isinstance(refused, InvalidArgument) and "not a regular file" in str(refused)
    with pytest.raises(InvalidArgument):
        signing.load_key(tmp_path)
    (tmp_path / "key").write_bytes(KEY)
    os.symlink(tmp_path / "key", tmp_path / "mounted")   # a mounted secret is often a link
    assert signing.load_key(tmp_path / "mounted") == KEY


def _in_thread(call, timeout: float = 10.0):
    """What ``call`` returned or raised, failing the test (not hanging it) past ``timeout``."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except BaseException as exc:   # the test inspects it
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert outcome, f"no answer within {timeout} s"
    return outcome[0]


def test_the_node_signs_with_its_key_file_answers_untrusted_capsule_and_refuses_a_missing_key(ros_context, tmp_path):
    pytest.importorskip("rclpy")
    from ros_harness import Harness

    capsules = tmp_path / "capsules"
    key_file = tmp_path / "capsule.key"
    key_file.write_bytes(KEY)
    h = Harness(ros_context, {"capsule_dir": str(capsules), "capsule_key_file": str(key_file)})
    try:
        done = h.call("snapshot", name="signed", tier="disk")
        assert done.success
        header, _ = diskformat.read(diskformat.path_for(capsules, done.capsule_id), key=KEY)
        assert signing.FIELD in header
        _forge_history(diskformat.path_for(capsules, done.capsule_id))
        refused = h.call("restore", capsule_id=done.capsule_id)
        assert not refused.success and refused.error_code == ErrorCode.UNTRUSTED_CAPSULE, refused.message
    finally:
        h.close()
    missing = Harness(ros_context, {"capsule_key_file": str(tmp_path / "absent")}, activate=False)
    try:
        missing.node.trigger_configure()
        assert missing.node.engine is None and missing.node.label == "unconfigured"
    finally:
        missing.close()


def test_a_fifo_key_file_fails_configure_and_the_node_still_answers_its_lifecycle_services(ros_context, tmp_path):
    pytest.importorskip("rclpy")
    from lifecycle_msgs.msg import State, Transition
    from lifecycle_msgs.srv import ChangeState, GetState
    from ros_harness import Harness, wait_future

    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    h = Harness(ros_context, {"capsule_key_file": str(fifo)}, activate=False)
    try:
        change = h.client.create_client(ChangeState, "/flashrt/change_state")
        get = h.client.create_client(GetState, "/flashrt/get_state")
        assert change.wait_for_service(timeout_sec=10) and get.wait_for_service(timeout_sec=10)
        configure = ChangeState.Request(transition=Transition(id=Transition.TRANSITION_CONFIGURE))
        assert not wait_future(change.call_async(configure), 20).success
        state = wait_future(get.call_async(GetState.Request()), 10).current_state
        assert state.id == State.PRIMARY_STATE_UNCONFIGURED and h.node.engine is None
        assert h.call("list_capsules").error_code == ErrorCode.NOT_ACTIVE
    finally:
        h.close()
