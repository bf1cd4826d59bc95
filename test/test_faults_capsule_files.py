"""Damaged capsule files, every kind: refused with CORRUPT_CAPSULE or FINGERPRINT_MISMATCH,
skipped at start with a warning, the live state untouched, memory bounded."""
from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashrt_ros.capsule import CapsuleError
from flashrt_ros.errors import ErrorCode
from flashrt_ros.runtime import Engine, ModelConfig

REFUSED = {ErrorCode.CORRUPT_CAPSULE, ErrorCode.FINGERPRINT_MISMATCH}
TALLY: dict[str, list[int]] = {}  # class -> [tried, handled]; printed by the last test


def _count(kind: str, handled: bool) -> None:
    row = TALLY.setdefault(kind, [0, 0])
    row[0] += 1
    row[1] += int(handled)


def _engine(folder: Path) -> Engine:
    return Engine.from_config(ModelConfig.tiny(), max_seq_len=128, capsule_dir=str(folder))


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """One good disk capsule: (engine, capsule id, its file's bytes, its path)."""
    folder = tmp_path_factory.mktemp("capsules")
    engine = _engine(folder)
    engine.prefill(list(range(1, 41)))
    info = engine.snapshot(tier="disk", name="good")
    engine.generate(3)
    path = next(folder.glob("*.capsule"))
    return engine, info.id, path.read_bytes(), path


def _layout(blob: bytes) -> tuple[int, dict]:
    n = struct.unpack("<Q", blob[:8])[0]
    return n, json.loads(blob[8:8 + n])


def _with_header(blob: bytes, header: dict) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + blob[8 + _layout(blob)[0]:]


def _with_capsule_header(blob: bytes, edit) -> bytes:
    n, header = _layout(blob)
    ours = json.loads(header["__metadata__"]["flashrt_capsule"])
    edit(ours)
    header["__metadata__"]["flashrt_capsule"] = json.dumps(ours)
    return _with_header(blob, header)


def _damage(original, damaged: bytes, kind: str) -> None:
    """Write ``damaged`` over the capsule's file; the engine that holds it must refuse it on
    restore (live state untouched), and a new engine on the folder must skip it."""
    engine, capsule_id, good, path = original
    before = engine.state_digest()
    path.write_bytes(damaged)
    try:
        with pytest.raises(CapsuleError) as refused:
            engine.restore(capsule_id)
        restore_ok = refused.value.code in REFUSED and engine.state_digest() == before
        fresh = _engine(path.parent)
        skip_ok = capsule_id not in {c.id for c in fresh.capsules.list()}
        fresh.close()
        assert restore_ok, (kind, refused.value.code, str(refused.value))
        assert skip_ok, kind
        _count(kind, True)
    except BaseException:
        _count(kind, False)
        raise
    finally:
        path.write_bytes(good)


def _cases(blob: bytes) -> dict[str, bytes]:
    n, header = _layout(blob)
    start = 8 + n
    cases = {"zero-length file": b""}
    for cut in sorted({1, 7, 8, 9, 8 + n // 2, start - 1, start, start + 1, (start + len(blob)) // 2, len(blob) - 1}):
        cases[f"truncated at byte {cut}"] = blob[:cut]
    cases["header length = 2**63"] = struct.pack("<Q", 2**63) + blob[8:]
    cases["header length past the end"] = struct.pack("<Q", len(blob)) + blob[8:]
    cases["header length too short"] = struct.pack("<Q", n - 16) + blob[8:]
    cases["header length 0"] = struct.pack("<Q", 0) + blob[8:]
    cases["oversize header (200 MB claimed)"] = struct.pack("<Q", 200 << 20) + blob[8:]
    cases["non-JSON header"] = blob[:8] + b"\xff" * n + blob[start:]
    cases["wrong magic: text file"] = b"this is not a capsule\n" * 10
    size = len(blob) - start
    lies = {"shape larger than the data": {"shape": [size * 4], "data_offsets": [0, size * 4]},
            "shape smaller than the data": {"shape": [size // 2], "data_offsets": [0, size // 2]},
            "dtype F32": {"dtype": "F32", "shape": [size // 4]},
            "offsets past the end": {"data_offsets": [size, size * 2]},
            "offsets reversed": {"data_offsets": [size, 0]}}
    for name, lie in lies.items():
        cases[f"safetensors header lies: {name}"] = _with_header(blob, {**header, "state": {**header["state"], **lie}})
    cases["a second tensor"] = _with_header(blob, {**header, "extra": dict(header["state"])})
    cases["no capsule header"] = _with_header(blob, {k: v for k, v in header.items() if k != "__metadata__"})
    edits = {
        "version 99": lambda h: h.update(version=99),
        "missing id": lambda h: h.pop("id"),
        "negative position": lambda h: h.update(position=-5),
        "ranges that lie": lambda h: h.update(ranges=[[0, 10]]),
        "digest of other bytes": lambda h: h.update(digest="0" * 64),
        "other model fingerprint": lambda h: h.update(model_fingerprint="f" * 32),
        "other layout fingerprint": lambda h: h.update(layout_fingerprint="f" * 32),
        "region table that lies": lambda h: h["region_table"][0].update(nbytes=1),
        "name that is a path": lambda h: h.update(name="../../etc/passwd"),
    }
    for name, edit in edits.items():
        cases[f"capsule header: {name}"] = _with_capsule_header(blob, edit)

    def resealed(h):  # a lie with a matching header digest: caught by the checks behind it
        from flashrt_ros.capsule.diskformat import _header_digest

        h.update(position=h["position"] + 1)
        h["header_digest"] = _header_digest(h)

    cases["capsule header: resealed position lie"] = _with_capsule_header(blob, resealed)

    # Rollback replays the log, so a malformed one must not load even with a matching seal. (A
    # well-formed log of another history can only be told apart by the engine that took the
    # capsule: the header digest is a checksum, not a signature.)
    def resealed_log(runs):
        def edit(h):
            from flashrt_ros.capsule.diskformat import _header_digest

            h["log"] = runs
            h["header_digest"] = _header_digest(h)
        return edit

    position = json.loads(header["__metadata__"]["flashrt_capsule"])["position"]
    logs = {"not a list": 7, "a run that skips a position": [["prefill", 1, position - 1]],
            "runs short of the position": [["prefill", 0, position - 1]],
            "counts as text": [["prefill", "0", str(position)]]}
    for name, runs in logs.items():
        cases[f"capsule header: resealed log lie, {name}"] = _with_capsule_header(blob, resealed_log(runs))
    return cases


def test_every_enumerated_kind_of_damage_is_refused(original):
    for kind, damaged in _cases(original[2]).items():
        _damage(original, damaged, kind)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_a_flipped_byte_anywhere_is_refused(original, data):
    blob = original[2]
    n, _ = _layout(blob)
    where = data.draw(st.sampled_from(["length", "header", "data"]))
    lo, hi = {"length": (0, 8), "header": (8, 8 + n), "data": (8 + n, len(blob))}[where]
    offset = data.draw(st.integers(lo, hi - 1))
    mask = data.draw(st.integers(1, 255))
    damaged = bytearray(blob)
    damaged[offset] ^= mask
    _damage(original, bytes(damaged), f"flipped byte in the {where}")


def test_loading_damaged_files_allocates_bounded_memory(original, tmp_path, caplog):
    """Hostile sizes are checked against the file before anything is allocated."""
    def rss_mb() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    blob = original[2]
    for i, (kind, damaged) in enumerate(_cases(blob).items()):
        (tmp_path / f"{i:016x}.capsule").write_bytes(damaged)
    before = rss_mb()
    with caplog.at_level(logging.WARNING):
        engine = _engine(tmp_path)
    grew = rss_mb() - before
    assert engine.capsules.list() == []
    assert sum("skipping capsule file" in r.message for r in caplog.records) == len(_cases(blob))
    assert grew < 100, f"RSS grew {grew:.0f} MB loading {len(_cases(blob))} damaged files"
    engine.close()


def test_zz_print_the_tally():
    for kind, (tried, handled) in sorted(TALLY.items()):
        print(f"FAULT corrupt-file | {kind} | tried {tried} | handled {handled}")
    assert all(tried == handled for tried, handled in TALLY.values())
