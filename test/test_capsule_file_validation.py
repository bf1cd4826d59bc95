"""One validation of capsule files: a file a running engine restores loads at the next start,
and one that will not load is not restored. Edits below reseal the header (its digests
recomputed, as anyone can without a key)."""
from __future__ import annotations

import pytest

from flashrt_ros.capsule import CapsuleError, diskformat
from flashrt_ros.runtime import Engine, ModelConfig


def _engine(folder) -> Engine:
    return Engine.from_config(ModelConfig.tiny(), max_seq_len=64, capsule_dir=folder)


def _reseal(path, edit) -> None:
    header, data = diskformat.read(path)
    for key in ("version", "header_digest"):
        header.pop(key)
    edit(header)
    diskformat.write(path, header, data)


def _set(key, value):
    return lambda header: header.__setitem__(key, value)


def _region_table(header) -> None:
    header["region_table"][0] = {**header["region_table"][0], "name": "renamed"}


EDITS = {
    "history_hash": _set("history_hash", "0" * 64),
    "region_table": _region_table,
    "created": lambda h: h.__setitem__("created", h["created"] + 1.0),
    "name": _set("name", "other"),
    "position as a float": lambda h: h.__setitem__("position", float(h["position"])),
    "pinned": lambda h: h.__setitem__("pinned", not h["pinned"]),
    "parent": _set("parent", "0123456789abcdef"),
    # Not read: a capsule's size is what its file holds, whatever the header says.
    "nbytes": lambda h: h.__setitem__("nbytes", h["nbytes"] + 1),
    # Another history for the same bytes: what a later rollback(to_position) would replay.
    "boundary log": _set("log", [["prefill", 0, 2], ["prefill", 2, 3]]),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_an_edited_header_is_refused_by_the_running_engine_and_judged_alike_at_the_next_start(tmp_path, edit):
    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3, 4, 5])
    capsule = engine.snapshot("kept", tier="disk")
    engine.generate(2)
    live = engine.state_digest()
    _reseal(diskformat.path_for(tmp_path, capsule.id), EDITS[edit])
    try:
        engine.restore(capsule.id)
        restored = True
    except CapsuleError:
        restored = False
    if not restored:
        assert engine.state_digest() == live and engine.position == 7
    engine.close()
    loads = capsule.id in {c.id for c in _engine(tmp_path).capsules.list()}
    # A capsule that restores today loads tomorrow; one that will not load does not restore.
    assert (not restored or loads) and (loads or not restored)
    # Every edit of a field that is read makes the file describe another capsule than the one
    # the running engine wrote, which it then refuses.
    assert restored == (edit == "nbytes")


def test_an_unedited_file_restores_on_the_running_engine_and_loads_at_the_next_start(tmp_path):
    engine = _engine(tmp_path)
    engine.prefill([1, 2, 3, 4, 5])
    capsule = engine.snapshot("kept", tier="disk", pin=True)
    engine.generate(2)
    engine.restore(capsule.id)
    assert engine.state_digest() == capsule.digest
    engine.close()
    again = _engine(tmp_path)
    assert [c.id for c in again.capsules.list()] == [capsule.id]
    again.restore(capsule.id)
    assert again.state_digest() == capsule.digest and again.capsules.get(capsule.id) == capsule
