"""Refusals: each bad capsule request gets its error code, and the live state does not change."""
from __future__ import annotations

import logging

import pytest

from flashrt_ros.capsule import CapsuleError
from flashrt_ros.errors import ErrorCode
from flashrt_ros.runtime import Engine, ModelConfig

PROMPT = list(b"Hold position until the door opens. ")


@pytest.fixture
def disk_engine(tmp_path):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    engine.prefill(PROMPT)
    return engine


def _refused(engine: Engine, code: ErrorCode, call) -> str:
    before, position = engine.state_digest(), engine.position
    with pytest.raises(CapsuleError) as info:
        call()
    assert info.value.code == code, str(info.value)
    assert str(info.value)
    assert engine.state_digest() == before and engine.position == position
    return str(info.value)


def test_unknown_capsule(disk_engine):
    assert "no capsule" in _refused(disk_engine, ErrorCode.UNKNOWN_CAPSULE, lambda: disk_engine.restore("nope"))
    _refused(disk_engine, ErrorCode.UNKNOWN_CAPSULE, lambda: disk_engine.capsules.drop("nope"))
    _refused(disk_engine, ErrorCode.UNKNOWN_CAPSULE, lambda: disk_engine.fork("nope"))


def test_capsule_of_a_foreign_model_is_refused(disk_engine):
    other = Engine.from_config(ModelConfig.tiny(), seed=1, max_seq_len=256)
    other.prefill(PROMPT)
    foreign = other.snapshot()
    assert "model" in _refused(disk_engine, ErrorCode.FINGERPRINT_MISMATCH, lambda: disk_engine.restore(foreign))
    # A fork of it is refused the same way, not as an unknown id.
    assert "model" in _refused(disk_engine, ErrorCode.FINGERPRINT_MISMATCH, lambda: disk_engine.fork(foreign))


def test_capsule_of_a_foreign_layout_is_refused(disk_engine):
    other = Engine.from_config(ModelConfig.tiny(), max_seq_len=512)
    other.prefill(PROMPT)
    foreign = other.snapshot()
    assert "layout" in _refused(disk_engine, ErrorCode.FINGERPRINT_MISMATCH, lambda: disk_engine.restore(foreign))


def test_flipped_byte_in_a_disk_capsule_is_refused(disk_engine):
    capsule = disk_engine.snapshot("c", tier="disk")
    path = next(disk_engine.capsules.dir.glob("*.capsule"))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    disk_engine.generate(3)
    _refused(disk_engine, ErrorCode.CORRUPT_CAPSULE, lambda: disk_engine.restore(capsule))


def test_truncated_disk_capsule_is_refused(disk_engine):
    capsule = disk_engine.snapshot("c", tier="disk")
    path = next(disk_engine.capsules.dir.glob("*.capsule"))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _refused(disk_engine, ErrorCode.CORRUPT_CAPSULE, lambda: disk_engine.restore(capsule))


def test_corrupt_and_foreign_files_are_skipped_at_start_with_a_warning(tmp_path, caplog):
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    engine.prefill(PROMPT)
    good = engine.snapshot("good", tier="disk")
    bad = engine.snapshot("bad", tier="disk")
    (tmp_path / f"{bad.id}.capsule").write_bytes(b"not a capsule at all")
    foreign = Engine.from_config(ModelConfig.tiny(), seed=5, max_seq_len=256, capsule_dir=tmp_path / "other")
    foreign.prefill(PROMPT)
    alien = foreign.snapshot("alien", tier="disk")
    (tmp_path / "other" / f"{alien.id}.capsule").rename(tmp_path / f"{alien.id}.capsule")
    with caplog.at_level(logging.WARNING):
        restarted = Engine.from_config(ModelConfig.tiny(), max_seq_len=256, capsule_dir=tmp_path)
    assert [c.id for c in restarted.capsules.list()] == [good.id]
    assert bad.id in caplog.text and alien.id in caplog.text


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/b", "..", ".hidden", "x" * 200, "nul\0byte",
                                  "sp ace", "Ω"])
def test_names_that_could_become_paths_are_refused(disk_engine, name):
    message = _refused(disk_engine, ErrorCode.INVALID_ARGUMENT,
                       lambda: disk_engine.snapshot(name=name, tier="disk"))
    assert "invalid capsule name" in message
    assert list(disk_engine.capsules.dir.iterdir()) == []


def test_bad_tier_and_duplicate_names_are_refused(disk_engine):
    _refused(disk_engine, ErrorCode.INVALID_ARGUMENT, lambda: disk_engine.snapshot(tier="gpu9"))
    disk_engine.snapshot("once")
    _refused(disk_engine, ErrorCode.INVALID_ARGUMENT, lambda: disk_engine.snapshot("once"))


def test_a_name_cannot_take_the_form_of_a_capsule_id(disk_engine):
    """Lookups try ids first, so a name that is another capsule's id would reach that capsule."""
    first = disk_engine.snapshot()
    message = _refused(disk_engine, ErrorCode.INVALID_ARGUMENT, lambda: disk_engine.snapshot(name=first.id))
    assert "form of a capsule id" in message
    _refused(disk_engine, ErrorCode.INVALID_ARGUMENT, lambda: disk_engine.fork(first, name="0123456789abcdef"))
    assert [c.id for c in disk_engine.capsules.list()] == [first.id]


def test_disk_tier_without_a_folder_is_refused(tiny_engine):
    tiny_engine.prefill(PROMPT)
    _refused(tiny_engine, ErrorCode.INVALID_ARGUMENT, lambda: tiny_engine.snapshot(tier="disk"))
