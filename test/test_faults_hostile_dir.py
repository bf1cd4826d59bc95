"""What a capsule_dir may hold besides capsules (resealed headers, FIFOs, links, folders) and
odd arguments: each is skipped or refused with a CapsuleError, and the engine starts and serves."""
from __future__ import annotations

import os

import pytest

from flashrt_ros.capsule import CapsuleError, disk_capsules, diskformat
from flashrt_ros.errors import ErrorCode
from flashrt_ros.runtime import Engine, ModelConfig


def _engine(folder, **options) -> Engine:
    return Engine.from_config(ModelConfig.tiny(), max_seq_len=64, capsule_dir=folder, **options)


def _reseal(path, **changes) -> None:
    """Rewrite a capsule file with ``changes`` to its header, digests recomputed as anyone can."""
    header, data = diskformat.read(path)
    for key in ("version", "header_digest"):
        header.pop(key)
    diskformat.write(path, {**header, **changes}, data)


@pytest.mark.parametrize("created", [float("nan"), float("inf"), -0.5, 10 ** 400, 2.0 ** 40, True])
def test_a_resealed_creation_time_out_of_range_is_skipped(tmp_path, created, caplog):
    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3])
    bad = engine.snapshot("bad", tier="disk")
    engine.close()
    _reseal(diskformat.path_for(tmp_path, bad.id), created=created)
    assert _engine(tmp_path).capsules.list() == []
    assert "creation time out of range" in caplog.text


def test_a_header_nested_past_any_depth_is_skipped(tmp_path, caplog):
    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3])
    bad = engine.snapshot("bad", tier="disk")
    engine.close()
    path = diskformat.path_for(tmp_path, bad.id)
    header, data = diskformat.read(path)
    from safetensors.torch import save_file
    save_file({"state": data}, str(path), metadata={"flashrt_capsule": "[" * 5_000 + "]" * 5_000})
    assert _engine(tmp_path).capsules.list() == []
    assert "malformed capsule header (RecursionError)" in caplog.text


def test_fifos_links_and_folders_in_the_dir_neither_block_nor_stop_the_start(tmp_path, caplog):
    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3])
    real = engine.snapshot("real", tier="disk")
    engine.close()
    os.mkfifo(tmp_path / f"{'a' * 16}{diskformat.SUFFIX}")                       # opening it would block
    os.symlink(diskformat.path_for(tmp_path, real.id), tmp_path / f"{'b' * 16}{diskformat.SUFFIX}")
    (tmp_path / f".{'c' * 16}{diskformat.SUFFIX}.1.tmp").mkdir()                 # not a temp file of ours
    notes = tmp_path / f".notes{diskformat.SUFFIX}.draft.tmp"
    notes.write_text("not written by a capsule writer")
    engine = _engine(tmp_path)
    assert [c.id for c in engine.capsules.list()] == [real.id]
    assert caplog.text.count("not a regular file") == 2
    assert notes.exists() and (tmp_path / f".{'c' * 16}{diskformat.SUFFIX}.1.tmp").is_dir()


@pytest.mark.parametrize("regions", [5, "kv", [1, "kv"], [["kv"]], [], ["kv", "nope"]])
def test_a_restore_of_bad_regions_is_refused_and_changes_nothing(regions):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    engine.prefill([1, 2, 3])
    capsule = engine.snapshot()
    engine.generate(3)
    before = engine.state_digest()
    with pytest.raises(CapsuleError, match="regions must be a list of groups") as info:
        engine.restore(capsule.id, regions=regions)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT and engine.state_digest() == before


def test_a_restore_of_groups_with_no_live_bytes_copies_nothing_and_succeeds():
    """A capsule at position 0 holds no KV rows: restoring its ["kv"] has nothing to copy."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=64)
    empty = engine.snapshot()
    engine.prefill([1, 2, 3])
    assert engine.restore(empty.id, regions=["kv"]).position == 0 and engine.position == 0
    assert len(engine.generate(2)) == 2


@pytest.mark.parametrize("budgets, words", [({1: 10, "x": 10}, "unknown tiers"),
                                            ({"device": 2 ** 62}, "cannot be allocated")])
def test_budgets_that_cannot_be_are_refused_at_construction(budgets, words):
    with pytest.raises(CapsuleError, match=words) as info:
        Engine.from_config(ModelConfig.tiny(), max_seq_len=64, budgets=budgets)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT


def test_a_drop_whose_file_cannot_go_fails_and_keeps_the_capsule(tmp_path):
    folder = tmp_path / "capsules"
    engine = _engine(folder)
    engine.prefill([1, 2, 3])
    kept = engine.snapshot("kept", tier="disk")
    used = engine.capsules.used_bytes("disk")
    moved = tmp_path / "moved"
    folder.rename(moved)
    folder.write_text("a file where the folder was")
    with pytest.raises(CapsuleError) as info:
        engine.capsules.drop(kept.id)
    assert info.value.code == ErrorCode.IO_ERROR
    assert [c.id for c in engine.capsules.list()] == [kept.id] and engine.capsules.used_bytes("disk") == used
    folder.unlink()
    moved.rename(folder)
    engine.capsules.drop(kept.id)
    assert engine.capsules.list() == [] and not any(folder.iterdir())


@pytest.mark.parametrize("pid", ["99999999999999999999", "4294967296", "\u00b2", "0"])
def test_temp_files_with_pids_no_process_has_are_left_alone_and_the_engine_starts(tmp_path, pid):
    odd = tmp_path / f".{'d' * 16}{diskformat.SUFFIX}.{pid}.tmp"   # "²" is a digit to isdigit(), not to int()
    odd.write_bytes(b"debris?")
    engine = _engine(tmp_path)
    assert engine.capsules.list() == [] and odd.exists()


def test_stale_temp_files_that_cannot_be_removed_do_not_stop_the_start(tmp_path, monkeypatch, caplog):
    import errno
    import pathlib

    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3])
    kept = engine.snapshot("kept", tier="disk")
    engine.close()
    stale = tmp_path / f".{kept.id}{diskformat.SUFFIX}.{2 ** 31 - 1}.tmp"   # no process has that pid
    stale.write_bytes(b"an interrupted write")
    real_unlink = pathlib.Path.unlink

    def read_only(path, missing_ok=False):   # a read-only folder (chmod would not stop root)
        if path.name.endswith(".tmp"):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(pathlib.Path, "unlink", read_only)
    assert [c.id for c in _engine(tmp_path).capsules.list()] == [kept.id]
    assert "cannot remove" in caplog.text and stale.exists()


def _one_disk_capsule(folder):
    engine = _engine(folder)
    engine.prefill([1, 2, 3])
    info = engine.snapshot("one", tier="disk")
    engine.close()
    return diskformat.path_for(folder, info.id)


def test_a_file_larger_than_this_engines_capsules_is_skipped_before_it_is_mapped(tmp_path, caplog):
    path = _one_disk_capsule(tmp_path)
    os.truncate(path, 2 ** 40)   # sparse: no disk space, but mapping it would ask for 1 TiB
    assert _engine(tmp_path).capsules.list() == []
    assert "more than a capsule of this engine's takes" in caplog.text


def test_a_header_longer_than_this_engines_capsules_write_is_skipped(tmp_path, caplog):
    longest = disk_capsules.most_header_chars(_engine(None).capsules.layout)   # the same layout, no folder
    path = _one_disk_capsule(tmp_path)
    _reseal(path, padding="x" * longest)   # parsed, a long header takes many times its size
    assert _engine(tmp_path).capsules.list() == []
    assert "more than this engine's capsules write" in caplog.text


@pytest.mark.parametrize("field", ["position", "nbytes"])
def test_a_resealed_bool_count_is_skipped(tmp_path, field, caplog):
    path = _one_disk_capsule(tmp_path)
    _reseal(path, **{field: True})   # isinstance(True, int) holds
    assert _engine(tmp_path).capsules.list() == []
    assert f"field '{field}' has the wrong type" in caplog.text


def test_a_capsule_file_swapped_for_a_fifo_after_start_is_refused_without_blocking(tmp_path):
    import subprocess
    import time

    path = _one_disk_capsule(tmp_path)
    engine = _engine(tmp_path)
    (capsule,) = engine.capsules.list()
    engine.prefill([4, 5])
    before = engine.state_digest()
    path.unlink()
    os.mkfifo(path)
    # Were the FIFO opened, the open would wait for a writer, holding the interpreter lock:
    # this one comes after 20 s, so that a regression fails the test rather than hanging it.
    writer = subprocess.Popen(["sh", "-c", f"sleep 20; : > '{path}'"])
    try:
        started = time.monotonic()
        with pytest.raises(CapsuleError, match="not a regular file") as info:
            engine.restore(capsule.id)
        assert time.monotonic() - started < 10
    finally:
        writer.kill()
        writer.wait()
    assert info.value.code == ErrorCode.CORRUPT_CAPSULE and engine.state_digest() == before


def test_a_temp_file_whose_writer_holds_its_lock_is_kept_though_its_pid_looks_gone(tmp_path):
    """A writer in another PID namespace (another container on the folder): its pid is no
    process here, but it holds the file's lock while it writes."""
    import fcntl

    busy = tmp_path / f".{'e' * 16}{diskformat.SUFFIX}.{2 ** 31 - 1}.tmp"
    busy.write_bytes(b"being written")
    with open(busy, "rb") as writer:
        fcntl.flock(writer.fileno(), fcntl.LOCK_EX)
        _engine(tmp_path).close()
        assert busy.exists()
    _engine(tmp_path).close()   # the lock is gone with its holder: debris now
    assert not busy.exists()


def test_a_capsule_is_written_under_its_lock_until_it_is_renamed(tmp_path, monkeypatch):
    real_replace, seen = os.replace, []

    def replace(source, target):
        seen.append(diskformat._being_written(source))
        real_replace(source, target)

    monkeypatch.setattr(diskformat.os, "replace", replace)
    _one_disk_capsule(tmp_path)
    assert seen == [True]


def test_a_capsule_file_swapped_for_a_fifo_after_it_is_opened_is_read_from_the_file_opened(tmp_path, monkeypatch):
    """A read opens the file once and checks what it opened: a FIFO put in its place after the
    check neither blocks the reader nor is read."""
    import subprocess
    import time

    path = _one_disk_capsule(tmp_path)
    engine = _engine(tmp_path)
    (capsule,) = engine.capsules.list()
    engine.prefill([4, 5])
    real_fstat, swaps = diskformat.os.fstat, []

    def check_then_swap(fd):   # the swap lands after the open, as the regular-file check runs
        result = real_fstat(fd)
        if not swaps:
            path.unlink()
            os.mkfifo(path)
            swaps.append(fd)
        return result

    monkeypatch.setattr(diskformat.os, "fstat", check_then_swap)
    writer = subprocess.Popen(["sh", "-c", f"sleep 20; : > '{path}'"])   # a regression fails, not hangs
    try:
        started = time.monotonic()
        engine.restore(capsule.id)
        assert time.monotonic() - started < 10
    finally:
        writer.kill()
        writer.wait()
    assert swaps and engine.position == capsule.position and engine.state_digest() == capsule.digest
    with pytest.raises(CapsuleError, match="not a regular file") as info:   # the next read opens the FIFO
        engine.restore(capsule.id)
    assert info.value.code == ErrorCode.CORRUPT_CAPSULE and engine.state_digest() == capsule.digest


def test_a_capsule_file_grown_as_it_is_read_is_read_no_further_than_its_checked_size(tmp_path, monkeypatch):
    path = _one_disk_capsule(tmp_path)
    engine = _engine(tmp_path)
    (capsule,) = engine.capsules.list()
    real_fstat, sizes = diskformat.os.fstat, []

    def check_then_grow(fd):   # the size is checked; the file grows to 1 TiB (sparse) right after
        result = real_fstat(fd)
        sizes.append(result.st_size)
        os.truncate(path, 2 ** 40)
        return result

    monkeypatch.setattr(diskformat.os, "fstat", check_then_grow)
    engine.restore(capsule.id)   # the bytes checked are read, not the terabyte
    assert sizes and engine.state_digest() == capsule.digest
    monkeypatch.undo()
    with pytest.raises(CapsuleError, match="bytes, more than a capsule of this engine's takes") as info:
        engine.restore(capsule.id)
    assert info.value.code == ErrorCode.CORRUPT_CAPSULE and engine.state_digest() == capsule.digest
