"""Capsule files in ``capsule_dir``: the folder of the disk tier (``CapsuleFolder``), the header
a capsule is written with, and every check a file passes before its bytes are trusted (on load
at start, and again on each read).

The byte format itself (safetensors, atomic writes) is ``diskformat``'s; the budget and
the records are the store's.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

import torch

from ..digest import history_digest, state_digest
from ..errors import shown
from . import diskformat
from .errors import CapsuleIOError, CorruptCapsule, FingerprintMismatch, InvalidCapsuleRequest
from .info import CapsuleInfo, check_compatible, check_name, is_capsule_id
from .layout import Layout
from .pieces import Record

log = logging.getLogger(__name__)


class DiskCapsule(NamedTuple):
    """A capsule file as read and checked: what it describes, and its bytes (owned, not mapped)."""

    info: CapsuleInfo
    log: tuple
    ranges: list[tuple[int, int]]
    data: torch.Tensor


class CapsuleFolder:
    """The capsule files of one folder, each written whole or not at all, and read back only
    through every check a capsule file passes, and as a capsule of this engine's model and
    layout. Which capsules stay, and the bytes they count, are the store's to decide."""

    def __init__(self, path: Path, layout: Layout, kinds: frozenset[str], model_fingerprint: str,
                 key: bytes | None) -> None:
        self.path, self.layout, self.kinds = path, layout, kinds
        self.model_fingerprint, self.key = model_fingerprint, key

    def write(self, info: CapsuleInfo, ranges: list[tuple[int, int]], data: torch.Tensor, log_runs: tuple) -> Path:
        path = diskformat.path_for(self.path, info.id)
        diskformat.write(path, header_for(info, ranges, log_runs), data, self.key)
        return path

    def discard(self, path: Path) -> None:
        """Remove the file of a capsule refused after it was written (the refusal stands)."""
        try:
            diskformat.remove(path)
        except OSError as exc:   # the file may come back at the next start
            log.warning("capsule file %s left behind after a refused write: %s", path.name, exc.strerror or exc)

    def reread(self, record: Record) -> DiskCapsule:
        """A disk capsule's file read and checked again: it must still describe the capsule it
        described when it was loaded or written."""
        capsule = reread(record.path, record.file_info, record.log, self.layout, self.kinds, self.key)
        self.check(capsule.info)
        return capsule

    def check(self, info: CapsuleInfo) -> None:
        check_compatible(info, self.model_fingerprint, self.layout.fingerprint)

    def load(self) -> list[Record]:
        """The records of the capsule files that pass every check, oldest first, least recently
        used by age. Files that do not pass are skipped with a warning; leftovers of an
        interrupted write are removed. Two files with one name (two engines shared the
        folder): the older capsule keeps it, the other is reached by its id."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            stale_files = diskformat.stale_temp_files(self.path)
            files = sorted(self.path.glob(f"*{diskformat.SUFFIX}"))
        except OSError as exc:
            raise CapsuleIOError(f"capsule_dir {self.path}: {exc.strerror or exc}") from None
        for stale in stale_files:   # debris of an interrupted write: never a capsule
            try:
                stale.unlink(missing_ok=True)
            except OSError as exc:   # a read-only folder still serves its capsules
                log.warning("cannot remove %s, left by an interrupted write: %s", stale.name, exc.strerror or exc)
        loaded = []
        for path in files:
            try:
                capsule = read(path, self.layout, self.kinds, self.key)
                self.check(capsule.info)
            except (CorruptCapsule, FingerprintMismatch, CapsuleIOError) as exc:
                log.warning("skipping capsule file %s: %s", path.name, exc)
                continue
            loaded.append(Record(capsule.info, [], capsule.log, path))
        loaded.sort(key=lambda r: r.info.created)
        now, names = time.time(), set()
        for record in loaded:
            info = record.info
            if info.name and info.name in names:
                log.warning("capsule file %s: name %r is taken by an older capsule; loaded without a name "
                            "(its id still reaches it)", record.path.name, info.name)
                info = record.info = info._replace(name="")
            names.add(info.name)
            record.last_used = time.monotonic() - max(0.0, now - info.created)
        return loaded


def read(path: Path, layout: Layout, kinds: frozenset[str], key: bytes | None = None) -> DiskCapsule:
    """The capsule file at ``path``, with every check a capsule file passes: the one validation,
    run when the folder is loaded at start and again on each read of a capsule loaded or
    written before, so that a file one path accepts the other does not refuse.
    Raises CorruptCapsule (UntrustedCapsule without a valid signature, with a ``key``),
    FingerprintMismatch for another region table, or CapsuleIOError. Whether the capsule is
    this engine's model and layout is ``check_compatible``'s."""
    header, data = diskformat.read(path, most_bytes(layout), most_header_chars(layout), key)
    info = info_from_header(header, layout.table)
    ranges = [tuple(r) for r in header["ranges"]]
    # What the file holds, whatever the header's own count says.
    info = info._replace(nbytes=data.numel())
    if not is_capsule_id(info.id) or path.name != diskformat.path_for(path.parent, info.id).name:
        raise CorruptCapsule(f"{path.name}: not the file of a capsule id (16 hex digits) {info.id!r:.40}")
    if info.position > layout.max_position:
        raise CorruptCapsule(f"{path.name}: position {info.position} is past this arena's "
                             f"{layout.max_position} rows")
    log_runs = log_from_header(header, info.position, kinds)   # what a rollback replays
    if merged(ranges) != layout.ranges(info.position):   # what a restore would write, exactly
        raise CorruptCapsule(f"{path.name}: holds other arena ranges than a capsule at position {info.position}")
    read_range = range_reader(ranges, data)
    if state_digest(layout.ranges(info.position), read_range) != info.digest:   # every stored byte
        raise CorruptCapsule(f"{path.name}: does not match its digest")
    if history_digest(layout.regions, info.position, read_range) != info.history_hash:
        raise CorruptCapsule(f"{path.name}: does not match its history hash")
    return DiskCapsule(info, log_runs, ranges, data)


def reread(path: Path, info: CapsuleInfo, log_runs: tuple, layout: Layout, kinds: frozenset[str],
           key: bytes | None = None) -> DiskCapsule:
    """``read``, refused unless the file still describes exactly the capsule it described when
    it was loaded or written (``info``, ``log_runs``: what the store holds of it)."""
    capsule = read(path, layout, kinds, key)
    if capsule.info != info or capsule.log != log_runs:
        changed = [k for k in CapsuleInfo._fields if getattr(capsule.info, k) != getattr(info, k)]
        raise CorruptCapsule(f"capsule {info.id}: file {path.name} no longer describes this capsule "
                             f"({', '.join(changed) or 'boundary log'} changed)")
    return capsule


def most_bytes(layout: Layout) -> int:
    """A bound on a capsule file of ``layout``: the data, and the header twice over
    (safetensors escapes it inside its own JSON)."""
    return layout.nbytes + 2 * most_header_chars(layout) + 4096


def most_header_chars(layout: Layout) -> int:
    """A bound on the header a capsule of ``layout`` is written with: the info, an entry of the
    region table per region, a run of the boundary log per position at most (each far under
    the room given here)."""
    return 4096 + 512 * len(layout.regions) + 64 * (layout.max_position + 1)


def merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Ranges in order, touching ones joined (overlapping or unordered ones kept apart, so
    that they never compare equal to a layout's ranges)."""
    out: list[tuple[int, int]] = []
    for s, e in ranges:
        if out and s == out[-1][1]:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def range_reader(ranges: Sequence[tuple[int, int]], data: torch.Tensor) -> Callable[[int, int], object]:
    """``read(start, end)`` of arena bytes from ``data``, which holds ``ranges`` end to end."""
    starts, offset = [], 0
    for s, e in ranges:
        starts.append((s, e, offset))
        offset += e - s
    array = data.numpy()

    def read(start: int, end: int):
        parts = []
        for s, e, off in starts:
            lo, hi = max(s, start), min(e, end)
            if lo < hi:
                parts.append(array[off + lo - s:off + hi - s])
        if sum(p.size for p in parts) != end - start:
            raise CorruptCapsule(f"capsule data does not cover arena bytes [{start}, {end})")
        return parts
    return read


_INFO_KEYS = ("id", "name", "parent", "position", "nbytes", "tier", "pinned", "created", "model_fingerprint",
              "layout_fingerprint", "digest", "history_hash")


def log_from_header(header: dict, position: int, kinds: frozenset[str] = frozenset()) -> tuple:
    """The boundary log: runs [kind, start, count] that tile positions [0, position) in order,
    each of a kind the engine replays (``kinds``; any, if empty). Rollback replays it, so a
    header that lies here must not load."""
    runs, end = header.get("log"), 0
    if not isinstance(runs, list):
        raise CorruptCapsule("capsule header log is not a list of runs")
    for run in runs:
        if not (isinstance(run, list) and len(run) == 3 and isinstance(run[0], str)
                and (not kinds or run[0] in kinds)
                and all(isinstance(x, int) and not isinstance(x, bool) for x in run[1:])
                and run[1] == end and run[2] >= 1):
            raise CorruptCapsule(f"capsule header log run {str(run)[:60]} does not continue at position {end}")
        end += run[2]
    if end != position:
        raise CorruptCapsule(f"capsule header log covers {end} positions, the capsule has {position}")
    return tuple(tuple(run) for run in runs)


def header_for(info: CapsuleInfo, ranges: Sequence[tuple[int, int]], log_runs: tuple) -> dict:
    """The JSON header of the capsule's file: its info, the arena ranges its bytes fill, its boundary log."""
    return ({k: getattr(info, k) for k in _INFO_KEYS} | {"region_table": list(info.region_table)}
            | {"ranges": [list(r) for r in ranges], "log": [list(run) for run in log_runs]})


_LATEST_CREATED = 2.0 ** 31   # seconds since 1970: a ROS Time's int32 seconds end there (2038)


def info_from_header(header: dict, table: tuple[dict, ...]) -> CapsuleInfo:
    try:
        fields = {k: header[k] for k in _INFO_KEYS}
        types = {"position": int, "nbytes": int, "pinned": bool, "created": (int, float)}
        for key, value in fields.items():
            if not isinstance(value, types.get(key, str)) or (key in ("position", "nbytes") and isinstance(value, bool)):
                raise CorruptCapsule(f"capsule header field {key!r} has the wrong type")
        if fields["position"] < 0:
            raise CorruptCapsule("capsule header has a negative position")
        # A creation time as time.time() gives one: ages, LRU order and ROS stamps are computed from it.
        if isinstance(fields["created"], bool) or not 0 <= fields["created"] < _LATEST_CREATED:
            raise CorruptCapsule(f"capsule header has a creation time out of range: {shown(fields['created'])}")
        check_name(fields["name"])
        if tuple(header["region_table"]) != table:
            raise FingerprintMismatch("capsule region table differs from this engine's arena")
    except (KeyError, TypeError, InvalidCapsuleRequest) as exc:
        raise CorruptCapsule(f"capsule header is malformed ({exc})") from None
    return CapsuleInfo(**{**fields, "tier": "disk"}, region_table=table)
