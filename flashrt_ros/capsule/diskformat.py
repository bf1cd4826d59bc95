"""The on-disk capsule: one safetensors file, verified when read.

The file holds one uint8 tensor, ``state``: the capsule's live bytes, range
after range, and a JSON header under the metadata key ``flashrt_capsule``
(ids, fingerprints, digest, region table, ranges). The data is exactly the bytes the
capsule digest covers (``flashrt_ros.digest``), which ``disk_capsules`` checks; the header
has its own ``header_digest``, so a flipped byte anywhere is caught. With a key, the
header, which names the digest, is signed too (``signing``). It is written to a temp file, fsynced, renamed into place
and the folder fsynced, so a crash leaves either the old set of files or the new one. It is
read whole into memory the process owns, never mapped. The file name comes from the capsule
id, never from its user-given name. No pickle anywhere.
"""
from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

try:
    import fcntl
except ImportError:   # no flock (Windows): temp files are told apart by their writer's pid alone
    fcntl = None

import torch
from blake3 import blake3

from . import signing
from .errors import CapsuleIOError, CorruptCapsule

SUFFIX = ".capsule"
VERSION = 3   # 3: the capsule digest covers every stored byte (no data_digest of its own)
_KEY = "flashrt_capsule"


def _header_digest(header: dict) -> str:
    return blake3(signing.canonical(header, ("header_digest",))).hexdigest(length=16)


def path_for(folder: Path, capsule_id: str) -> Path:
    return folder / f"{capsule_id}{SUFFIX}"


def write(path: Path, header: dict, data: torch.Tensor, key: bytes | None = None) -> None:
    """Atomically write ``data`` (uint8, host) with ``header``, signed with ``key`` when one is
    given; raises CapsuleIOError."""
    # The writer's pid in the name: an engine starting on the same folder removes only the
    # debris of writers that are gone, never a file another engine is writing.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    placed, held = False, -1
    try:
        held = _hold(tmp)
        data = data.contiguous()
        full = {"version": VERSION, **header}
        full.pop(signing.FIELD, None)
        if key is not None:
            full[signing.FIELD] = signing.sign(key, full)
        full["header_digest"] = _header_digest(full)
        # Framed here and written into the held file from the data's own memory: safetensors'
        # save_file writes a temp file of its own (".tmpXXXXXX"), which a crash mid-write left
        # where no cleaner looks, and its save() makes a second copy of the bytes.
        _write_all(held, [_prefix(json.dumps(full), data.numel()), memoryview(data.numpy())])
        os.fsync(held)
        os.replace(tmp, path)
        placed = True
        _sync_folder(path.parent)
    except BaseException as exc:
        # A failure after the rename leaves the file under its final name: the caller counts
        # the capsule as not written (it may drop it), so a restart must not find it there.
        # Also on a MemoryError or a Ctrl-C: this process lives on, so no start would remove it.
        for leftover in (path, tmp) if placed else (tmp,):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:  # the folder itself is gone or is not a folder: nothing was left there
                pass
        if isinstance(exc, OSError):
            raise CapsuleIOError(f"cannot write capsule {path.name}: {getattr(exc, 'strerror', None) or exc}") from None
        raise
    finally:
        if held >= 0:
            os.close(held)


def _prefix(meta: str, count: int) -> bytes:
    """What precedes a capsule's bytes in its file: the safetensors framing of one uint8 tensor
    ``state`` of ``count`` bytes, with the capsule header as its metadata (an 8-byte
    little-endian length, then the JSON table, padded with spaces to 8 bytes as safetensors
    pads it). ``_framing`` reads it back; safetensors itself reads the file too (a test)."""
    table = json.dumps({"__metadata__": {_KEY: meta},
                        "state": {"dtype": "U8", "shape": [count], "data_offsets": [0, count]}},
                       separators=(",", ":")).encode()
    table += b" " * (-len(table) % 8)
    return len(table).to_bytes(8, "little") + table


def _write_all(fd: int, parts: list) -> None:
    for part in parts:
        view, done = memoryview(part).cast("B"), 0
        while done < len(view):
            done += os.write(fd, view[done:])


def _hold(path: Path) -> int:
    """The file at ``path``, made or emptied, open for writing and locked (flock) until the
    descriptor is closed: to an engine in another PID namespace (another container on the
    same folder) the pid in the name is someone else's or no one's, but the lock is held."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _being_written(path: Path) -> bool:
    """Whether a writer holds the file's lock (or the file cannot be looked at: not ours to delete)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:   # BlockingIOError: held
        return True
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a capsule file for good: the folder is synced too, or a power loss could
    bring a dropped capsule back. Raises OSError if the file cannot be deleted."""
    path.unlink(missing_ok=True)
    try:
        _sync_folder(path.parent)
    except OSError:   # the file is gone from the folder as this system sees it; nothing to undo
        pass


def _sync_folder(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def stale_temp_files(folder: Path) -> list[Path]:
    """Temp files of interrupted writes (named as ``write`` names them, plain files) whose
    writer's process is gone and whose lock no one holds. Anything else is not ours to delete."""
    stale = []
    for tmp in folder.glob(f".*{SUFFIX}.*.tmp"):
        pid = tmp.name[:-len(".tmp")].rpartition(".")[2]
        # ASCII digits of a pid os.kill takes: isdigit() alone passes "²", which int() refuses.
        if not (pid.isascii() and pid.isdecimal() and 0 < int(pid) < 2 ** 31) or not is_plain_file(tmp):
            continue
        if int(pid) == os.getpid() or _alive(int(pid)) or _being_written(tmp):
            continue   # being written, by this process or by another one still running
        stale.append(tmp)
    return stale


def is_plain_file(path: Path) -> bool:
    """A regular file, not a link to one: a FIFO would block the reader that opens it, and
    dropping a capsule reached through a link would delete the link, not the bytes."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # someone else's process
        return True
    return True


def read(path: Path, most_bytes: int | None = None, most_header: int | None = None,
         key: bytes | None = None) -> tuple[dict, torch.Tensor]:
    """The capsule file's JSON header and its stored bytes, read once into memory this process
    owns and checked: the framing, the header digest and the signature (with a ``key``); the
    bytes against the capsule's digest are ``disk_capsules``' check. Raises CorruptCapsule
    (UntrustedCapsule for the signature) or CapsuleIOError.

    The file is opened once (no link followed, a FIFO never waited on), checked to be a
    regular file of at most ``most_bytes`` before a byte is read, and read with ``read`` calls,
    never mapped: nothing returned refers to the file's pages, so a file truncated or changed
    afterwards cannot fault the process or change a byte it holds, and a dropped capsule's
    blocks are freed. ``most_header``: the longest header this reader's capsules write
    (parsed JSON takes some 20 times its text)."""
    blob = _read_whole(path, most_bytes)
    header_text, start, stored = _framing(blob, path.name)
    if most_header is not None and len(header_text) > most_header:
        raise CorruptCapsule(f"{path.name}: a capsule header of {len(header_text)} characters, more than this "
                             f"engine's capsules write ({most_header})")
    try:
        header = json.loads(header_text)
        if not isinstance(header, dict) or header.get("version") != VERSION:
            raise CorruptCapsule(f"{path.name}: unsupported capsule header version "
                                 f"{header.get('version') if isinstance(header, dict) else None!r}")
    except (ValueError, RecursionError) as exc:   # RecursionError: JSON nested past any header's depth
        raise CorruptCapsule(f"{path.name}: missing or malformed capsule header ({type(exc).__name__})") from None
    if header.get("header_digest") != _header_digest(header):
        raise CorruptCapsule(f"{path.name}: capsule header does not match its header digest")
    signing.check(key, header, path.name)
    ranges = header.get("ranges")
    if (not isinstance(ranges, list)
            or not all(isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] <= r[1]
                       for r in ranges)
            or sum(e - s for s, e in ranges) != stored):
        raise CorruptCapsule(f"{path.name}: header ranges do not describe the stored bytes")
    return header, blob[start:start + stored]


def _read_whole(path: Path, most_bytes: int | None) -> torch.Tensor:
    """Every byte of the regular file at ``path``, in a tensor of its own."""
    try:   # O_NONBLOCK: a FIFO opens at once instead of waiting for a writer; O_NOFOLLOW: no link
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptCapsule(f"{path.name}: not a regular file (a symbolic link)") from None
        raise CapsuleIOError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCapsule(f"{path.name}: not a regular file")
        if most_bytes is not None and info.st_size > most_bytes:
            raise CorruptCapsule(f"{path.name}: {info.st_size} bytes, more than a capsule of this engine's "
                                 f"takes ({most_bytes})")
        blob = torch.empty(info.st_size, dtype=torch.uint8)
        view = memoryview(blob.numpy())
        done = 0
        while done < info.st_size:   # the size read by fstat bounds the read, whatever the file becomes
            got = os.preadv(fd, [view[done:]], done)
            if got == 0:
                raise CorruptCapsule(f"{path.name}: the file shrank to {done} bytes while it was read")
            done += got
        return blob
    except OSError as exc:
        raise CapsuleIOError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _framing(blob: torch.Tensor, name: str) -> tuple[str, int, int]:
    """A safetensors file holding one uint8 tensor ``state``, as ``write`` lays it out: an
    8-byte little-endian header length, the safetensors JSON header, then the tensor's bytes.
    Returns the capsule header's text (the ``__metadata__`` entry), where the bytes start, and
    how many there are."""
    size = blob.numel()
    length = int.from_bytes(blob[:8].numpy().tobytes(), "little") if size >= 8 else -1
    if not 0 < length <= size - 8:
        raise CorruptCapsule(f"{name}: not a readable safetensors file (header length {length} in {size} bytes)")
    try:
        table = json.loads(blob[8:8 + length].numpy().tobytes())
        meta, state = table["__metadata__"], table["state"]
        if set(table) != {"__metadata__", "state"} or not isinstance(meta.get(_KEY), str):
            raise ValueError(f"entries {sorted(table)[:4]}")
        count = state["shape"][0]
        if state["dtype"] != "U8" or state["shape"] != [count] or state["data_offsets"] != [0, count] \
                or 8 + length + count != size:
            raise ValueError(f"tensor 'state' {str(state)[:80]} in {size} bytes")
        # Byte for byte the framing ``_prefix`` writes: JSON that parses alike from other bytes
        # (a tab for a padding space) is covered by no digest, so it is refused here.
        if blob[:8 + length].numpy().tobytes() != _prefix(meta[_KEY], count):
            raise ValueError("framing bytes other than the ones this format writes")
    except (ValueError, RecursionError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise CorruptCapsule(f"{name}: not a capsule's safetensors layout ({type(exc).__name__}: "
                             f"{str(exc)[:120]})") from None
    return meta[_KEY], 8 + length, count
