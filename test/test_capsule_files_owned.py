"""Nothing the engine keeps after a call refers to a capsule file's pages: a disk capsule's
bytes are read, verified and copied into memory the process owns."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from flashrt_ros.capsule import diskformat
from flashrt_ros.runtime import Engine, ModelConfig


def _restored_from_disk(folder: Path) -> tuple[Engine, object, Path]:
    """The issue's sequence: a disk capsule restored, then two tokens built on it."""
    engine = Engine.from_config(ModelConfig.tiny(), max_seq_len=1024, capsule_dir=folder)
    engine.prefill([256] + [97] * 500)
    capsule = engine.snapshot(tier="disk")
    engine.generate(1)
    engine.restore(capsule.id)
    engine.generate(2)
    return engine, capsule, diskformat.path_for(folder, capsule.id)


def _mapped(path: Path) -> list[str]:
    """This process's mappings of the file at ``path`` (also once it is deleted)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if str(path) in line]


def _open_links(path: Path) -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if str(path) in link]


pytestmark = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc (Linux)")


def test_a_capsule_file_truncated_after_its_restore_does_not_crash_a_rollback(tmp_path):
    # In a process of its own: the fault this guards against is a SIGBUS, which kills the process.
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from pathlib import Path
        from test_capsule_files_owned import _restored_from_disk
        engine, capsule, path = _restored_from_disk(Path({str(tmp_path)!r}))
        os.truncate(path, 0)
        assert engine.rollback(steps=2) == capsule.position
        assert engine.state_digest() == capsule.digest
        print("rolled back", engine.position)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "rolled back 501" in done.stdout


def test_a_capsule_file_changed_in_place_after_its_restore_changes_nothing_the_engine_holds(tmp_path):
    from flashrt_ros.capsule import CapsuleError
    from flashrt_ros.errors import ErrorCode

    engine, capsule, path = _restored_from_disk(tmp_path)
    with open(path, "r+b") as f:   # every stored byte inverted where it lies, as an editor would
        start = 8 + int.from_bytes(f.read(8), "little")   # past the safetensors header
        f.seek(start)
        changed = bytes(b ^ 0xFF for b in f.read())
        f.seek(start)
        f.write(changed)
    assert engine.rollback(steps=2) == capsule.position
    assert engine.state_digest() == capsule.digest
    engine.generate(1)
    live = engine.state_digest()
    with pytest.raises(CapsuleError) as refused:   # the file itself is read afresh, and refused
        engine.restore(capsule.id)
    assert refused.value.code == ErrorCode.CORRUPT_CAPSULE and engine.state_digest() == live


def test_a_restore_leaves_no_mapping_of_the_file_and_a_drop_lets_its_blocks_go(tmp_path):
    engine, capsule, path = _restored_from_disk(tmp_path)
    assert _mapped(path) == [] and _open_links(path) == []
    engine.capsules.drop(capsule.id)
    assert not path.exists()
    # No mapping and no descriptor holds the deleted file, so the file system frees its blocks.
    assert _mapped(path) == [] and _open_links(path) == []
    assert engine.rollback(steps=2) == capsule.position and engine.state_digest() == capsule.digest
