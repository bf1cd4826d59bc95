"""The capsule store: capsules in three tiers, with budgets, LRU spill, sharing and integrity.

A capsule is a list of pieces, each mapping an arena byte range onto bytes
of a chunk. Chunks are immutable and reference-counted, so a fork or a
snapshot that extends an earlier capsule's token prefix points at the
earlier chunk instead of copying it: N branches of a P-token prefix cost
about P + N * delta bytes. Digests are computed off the snapshot path by
one background thread, from the capsule's own immutable copy.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
import weakref
from pathlib import Path
from typing import Callable, Iterable, NamedTuple, Sequence

import torch

from ..digest import history_digest, state_digest
from ..errors import shown
from . import disk_capsules, diskformat, span_copy
from .digest_queue import FINISHED, SETTLED, DigestQueue
from .errors import (BudgetExceeded, CapsuleIOError, CorruptCapsule, FingerprintMismatch, InvalidCapsuleRequest,
                     UnknownCapsule)
from .held_events import HeldEvents, Lockable
from .info import TIERS, CapsuleInfo, check_name, check_tier
from .layout import Layout
from .memory import Chunk, DevicePool, host_chunk

log = logging.getLogger(__name__)

_LOWER = {"device": "host", "host": "disk", "disk": None}
# A snapshot shares its base's token rows only while the base lies in at most this many pieces.
# Each snapshot of a chain (one per step, each extending the last) adds a piece per per-token
# region, and the slicing grows with them: the 600th of a chain took 3.1 ms against 171 us for
# the first (bench model). Past the bound the rows are copied whole and the chain starts over.
SHARE_PIECES = 64


class Piece(NamedTuple):
    """Arena bytes [start, end) are ``chunk.data[offset : offset + end - start]``.
    (A named tuple: a snapshot makes several, and a frozen dataclass costs 3x to build.)"""

    start: int
    end: int
    chunk: Chunk
    offset: int

    def view(self, start: int | None = None, end: int | None = None) -> torch.Tensor:
        s, e = self.start if start is None else start, self.end if end is None else end
        return self.chunk.data[self.offset + s - self.start:self.offset + e - self.start]


class Record:
    """A capsule inside the store: its info, where its bytes are, and its boundary log."""

    __slots__ = ("info", "_pieces", "log", "last_used", "path", "file_info", "job", "_plans")

    def __init__(self, info: CapsuleInfo, pieces: list[Piece], log_runs: tuple, path: Path | None = None) -> None:
        self.info, self._pieces, self._plans, self.log, self.path = info, pieces, {}, log_runs, path
        # A disk capsule: the info its file gave when it was loaded or written. Each later read
        # of the file must give it again (``info`` may differ: a name taken by an older capsule).
        self.file_info = info if path is not None else None
        self.last_used = time.monotonic()
        self.job = None   # the digest job (see DigestQueue); None: the digest is final

    @property
    def pieces(self) -> list[Piece]:
        return self._pieces

    @pieces.setter
    def pieces(self, pieces: list[Piece]) -> None:
        # The plans' views would keep the old chunks' memory alive (a spilled capsule's host buffer).
        self._pieces, self._plans = pieces, {}

    def pieces_in(self, start: int, end: int) -> list[Piece]:
        return _slice(self.pieces, start, end)

    def restore_plan(self, buffer: torch.Tensor, layout: Layout, keep_rows: int) -> "RestorePlan":
        """The copies that restore this capsule into ``buffer`` when its per-token rows
        [0:keep_rows] are there already. Sliced once and reused for the two cases that
        repeat: a full restore, and a return from a state that descends from this capsule
        (a checkpoint the robot keeps going back to)."""
        position = self.info.position
        keep = keep_rows if keep_rows < position else position   # not min(): every restore's path, cold
        plan = self._plans.get(keep)
        if plan is None or plan.buffer is not buffer:
            ranges = layout.ranges(position, keep)
            plan = RestorePlan(self.pieces, ranges, buffer, layout.fixed_bytes)
            if keep in (0, position):
                self._plans[keep] = plan
        return plan


class RestorePlan:
    """A restore's copies, prepared once: byte spans for one ``span_copy`` call on a CPU, else
    arena and capsule views paired up for one batched torch copy."""

    __slots__ = ("buffer", "arena", "capsule", "same_device", "spans", "fixed", "fixed_owner")

    def __init__(self, pieces: list[Piece], ranges: list[tuple[int, int]], buffer: torch.Tensor,
                 fixed_bytes: int) -> None:
        self.buffer = buffer
        parts = [q for s, e in ranges for q in _slice(pieces, s, e)]
        self.same_device = all(q.chunk.data.device == buffer.device for q in parts)
        self.spans = None
        if self.same_device and buffer.device.type == "cpu" and span_copy.available():
            # Pieces lie inside their chunks and arena ranges inside the buffer, by construction.
            at = span_copy.address_of(buffer, max(q.end for q in parts) if parts else 0)
            self.spans = span_copy.SpanCopy(_spans_into_arena(parts, at), keep=[q.chunk for q in parts])
            self.arena = self.capsule = []
        else:
            self.arena = [buffer[q.start:q.end] for q in parts]
            self.capsule = [q.view() for q in parts]
        fixed = _slice(pieces, 0, fixed_bytes)
        if len(fixed) == 1 and fixed[0].chunk.tier != "disk":   # a view of the capsule's own memory
            self.fixed, self.fixed_owner = fixed[0].view(), fixed[0].chunk
        elif len(fixed) == 1:   # bytes read from a file, which is all held until a copy of its part is
            self.fixed, self.fixed_owner = fixed[0].view().clone(), None
        else:
            self.fixed, self.fixed_owner = torch.cat([p.view() for p in fixed]), None

    def run(self, during: Callable[[], None] | None = None) -> None:
        """``during``: called while the bytes copy on a CPU (see ``span_copy.copy_rows``), else after
        the copies are queued; either way before this returns."""
        if self.spans is not None:
            self.spans(during)
            return
        if self.same_device:
            # One dispatch for every piece: on small states the per-copy Python cost is
            # what separates a restore from a plain copy of the same bytes.
            if self.arena:   # none for groups with no live bytes; torch refuses an empty list
                torch._foreach_copy_(self.arena, self.capsule, non_blocking=True)
        else:
            for dst, src in zip(self.arena, self.capsule):
                dst.copy_(src, non_blocking=True)
        if during is not None:
            during()


def _slice(pieces: list[Piece], start: int, end: int) -> list[Piece]:
    """Sub-pieces covering arena bytes [start, end) (possibly none)."""
    out = []
    for p in pieces:
        s, e = max(p.start, start), min(p.end, end)
        if s < e:
            out.append(Piece(s, e, p.chunk, p.offset + s - p.start))
    return out


def _spans_into_arena(pieces: list[Piece], arena_address: int) -> list[int]:
    """Flat (destination, source, length) triples for ``span_copy`` from each piece's chunk
    bytes to its arena bytes (the arena buffer at ``arena_address``): a restore's copies
    (a snapshot's are built in C, ``span_copy.copy_rows``)."""
    out: list[int] = []
    for p in pieces:
        out += (arena_address + p.start, p.chunk.address + p.offset, p.end - p.start)
    return out


def _same_bytes_until(a: list[Piece], b: list[Piece], start: int, end: int) -> int:
    """The arena byte up to which ``a`` and ``b`` map [start, end) onto the very same chunk
    bytes (both lists from ``_slice``, so sorted and touching); ``start`` if not even the first."""
    a, b = _slice(a, start, end), _slice(b, start, end)
    i = j = 0
    pos = start
    while pos < end and i < len(a) and j < len(b):
        pa, pb = a[i], b[j]
        if pa.start > pos or pb.start > pos or pa.chunk is not pb.chunk or \
                pa.offset - pa.start != pb.offset - pb.start:
            break
        pos = min(pa.end, pb.end)
        i += pos == pa.end
        j += pos == pb.end
    return pos


# Each store's id generator is seeded again in a forked child, and its ids made ahead are
# thrown away: the child would otherwise make the parent's ids (and overwrite its disk
# capsules in a shared capsule_dir).
_STORES: "weakref.WeakSet[CapsuleStore]" = weakref.WeakSet()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: [store._new_ids() for store in list(_STORES)])


class CapsuleStore:
    """Capsules by id and name; ``used_bytes`` and ``budget_bytes`` per tier."""

    def __init__(self, layout: Layout, model_fingerprint: str, device: torch.device,
                 budgets: dict[str, int], spill: bool, capsule_dir: str | Path | None,
                 on_event: Callable[[str, CapsuleInfo], None] | None = None,
                 lock: Lockable | None = None, log_kinds: Iterable[str] = (), key: bytes | None = None) -> None:
        """``key``: sign every capsule file written, and refuse any read without a valid
        signature (``signing``); None: files carry digests only."""
        unknown = sorted(set(budgets) - set(TIERS), key=repr)
        if unknown:
            raise InvalidCapsuleRequest(f"budgets name unknown tiers {unknown}; tiers are {', '.join(TIERS)}")
        for tier, value in budgets.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidCapsuleRequest(f"budget for {tier} must be an int >= 0, got {value!r}")
        self.layout, self.model_fingerprint, self.device = layout, model_fingerprint, device
        self.log_kinds = frozenset(log_kinds)   # boundary kinds the engine can replay
        self._key = key
        self.spill = spill
        self._budgets = dict(budgets)
        self._used = {t: 0 for t in TIERS}
        self._records: dict[str, Record] = {}
        # Capsules the call in progress works from: no spill it sets off, however far down the
        # tiers it cascades, may move or evict them.
        self._spared: list[Record] = []
        # The engine passes its own lock: one lock orders every state change, and
        # the digest thread's releases (which may touch the engine's rollback ring)
        # wait for the current step instead of racing it.
        self._lock = lock or threading.RLock()
        self._held = HeldEvents(self._lock, self._deliver)
        self._listeners: list[Callable[[str, CapsuleInfo], None]] = [on_event] if on_event else []
        self.before_free: list[Callable[[Chunk], None]] = []
        self._pin_host = device.type == "cuda"
        # Tiers whose chunks sit on the arena's device, where a snapshot is one batched copy.
        self._local = {"device": True, "host": device.type == "cpu"}
        self._span_copy = device.type == "cpu" and span_copy.available()   # else torch copies
        self._buffer: tuple[torch.Tensor, int] | None = None   # the arena buffer and its address
        self._ids, self._id_stock = random.Random(), []   # see _new_id
        _STORES.add(self)
        try:
            self.pool = DevicePool(self._budgets.get("device", 0), device)
        except (RuntimeError, MemoryError) as exc:   # torch's out-of-memory errors are RuntimeErrors
            raise InvalidCapsuleRequest(f"the device budget of {self._budgets.get('device', 0)} bytes cannot be "
                                        f"allocated on {device}: {str(exc).splitlines()[0][:200]}") from None
        self.dir = Path(capsule_dir) if capsule_dir else None
        self.digests = DigestQueue(self._compute_digest, self._release, self._lock, self._announce_digest)
        if self.dir is not None:
            self._load_disk()

    # ---- public queries ------------------------------------------------------------------------
    def subscribe(self, listener: Callable[[str, CapsuleInfo], None]) -> None:
        """``listener(kind, info)`` for every capsule event: snapshot, fork, drop, spill, evict."""
        self._listeners.append(listener)

    def list(self, tier: str | None = None) -> list[CapsuleInfo]:
        """Every capsule, or those of one tier (None or "" lists all)."""
        if tier not in (None, ""):
            check_tier(tier)
        with self._held:
            return [r.info for r in self._records.values() if tier in (None, "", r.info.tier)]

    def get(self, ref: str | CapsuleInfo, wait: bool = True) -> CapsuleInfo:
        """The capsule's info; with ``wait`` its digest is filled in first (computed here if
        the digest thread has not reached it)."""
        with self._held:  # one hold: a drop in between would leave a cancelled job's empty digest
            record = self.resolve(ref)
            if wait:
                self.digests.finish(record)
            return record.info

    @property
    def signed(self) -> bool:
        """Whether capsule files are signed, and unsigned ones refused (a key was given)."""
        return self._key is not None

    def used_bytes(self, tier: str) -> int:
        return self._used[check_tier(tier)]

    def budget_bytes(self, tier: str) -> int:
        return self._budgets.get(check_tier(tier), 0)

    def resolve(self, ref: str | CapsuleInfo) -> Record:
        key = ref.id if isinstance(ref, CapsuleInfo) else ref
        if not isinstance(key, str) or not key:
            raise InvalidCapsuleRequest(f"a capsule is named by a non-empty id or name, got {shown(key)}")
        with self._held:
            record = self._records.get(key)
            if record is None:
                record = next((r for r in self._records.values() if r.info.name == key), None)
        if record is None:
            raise UnknownCapsule(f"no capsule with id or name {shown(key)}")
        return record

    def keeps(self, record: Record) -> bool:
        """Whether ``record`` is still in the store (not dropped or evicted)."""
        with self._held:
            return self._records.get(record.info.id) is record

    def drop(self, ref: str | CapsuleInfo) -> CapsuleInfo:
        with self._held:
            record = self.resolve(ref)
            if record.path is not None:
                # The file first: one left behind would bring the capsule back at the next start.
                try:
                    diskformat.remove(record.path)
                except OSError as exc:
                    raise CapsuleIOError(f"cannot drop capsule {record.info.id}: {exc.strerror or exc}") from None
            self._remove(record, unlink=False)
            self._emit("drop", record.info)
        return record.info

    # ---- capture ---------------------------------------------------------------------------------
    def capture(self, buffer: torch.Tensor, position: int, *, name: str | None, tier: str, pin: bool,
                parent: str, base: tuple[Record, int] | None, log_runs: tuple) -> Record:
        """Copy the live state out of ``buffer`` into a new capsule.

        ``base`` = (record, p): the live per-token rows [0:p] are byte-equal to
        that record's, so they are referenced instead of copied.
        """
        name = check_name(name)
        check_tier(tier)
        with self._held:
            if name and any(r.info.name == name for r in self._records.values()):
                raise InvalidCapsuleRequest(f"capsule name {name!r} is already used")
            if tier == "disk":
                return self._capture_disk(buffer, position, name, pin, parent, log_runs)
            shared: list[Piece] = []
            start = 0
            if base is not None and base[0].info.id in self._records and base[0].info.tier == tier \
                    and len(base[0].pieces) <= SHARE_PIECES:
                start = min(base[1], position)
                for r in self.layout.regions:
                    if r.per_token and start:
                        shared += base[0].pieces_in(r.offset, r.offset + start * r.row_bytes)
            # Checked before anything is allocated: a refused buffer must leave no chunk behind.
            at = self._address_of(buffer) if self._local[tier] and self._span_copy else 0
            nbytes = self.layout.ranges_bytes(position, start)
            # In a CPU pool, where first fit will place the chunk is known before it is made: the
            # copy starts there at once, and the chunk is allocated while it runs (nothing else
            # changes the pool meanwhile: every change takes this lock). From a cold cache the
            # allocation took some 15 us before the copy could start (bench VM).
            into = self.pool.address_for(nbytes) if at and tier == "device" else 0
            chunk: Chunk | None = None
            record: Record | None = None

            def register(pieces: list[Piece] | None = None) -> None:
                nonlocal chunk, record
                if chunk is None:
                    chunk = self._allocate(tier, nbytes)
                    # A safety net for a bug: the bytes, already on their way to ``into``, cannot be
                    # called back, but a chunk elsewhere is never registered as holding them.
                    if chunk.address != into:
                        raise RuntimeError(f"capsule pool placed a chunk at {chunk.address:#x}, not {into:#x}")
                if pieces is None:
                    pieces = _pieces_over(chunk, self.layout.ranges(position, start))
                kept = sorted(shared + pieces, key=lambda p: p.start) if shared else pieces
                record = self._register(kept, position, name, tier, pin, parent, nbytes, log_runs)

            try:
                if not into:
                    try:
                        # Room is made without spilling the base: that would free the very rows shared here.
                        chunk = self._allocate(tier, nbytes, spare=base[0] if shared else None)
                    except BudgetExceeded:
                        if not shared:
                            raise
                        shared, start = [], 0   # copy it all; the base may go
                        nbytes = self.layout.ranges_bytes(position)
                        chunk = self._allocate(tier, nbytes)
                    into = chunk.address if at else 0
                if into:
                    # The other threads copy while this one does the bookkeeping, the allocation
                    # included (see the README's Capsule copies for the figures).
                    span_copy.copy_rows(into, at, self.layout.fixed_bytes, self.layout.rows, start, position,
                                        during=register)
                else:
                    ranges = self.layout.ranges(position, start)
                    pieces = _pieces_over(chunk, ranges)
                    if self._local[tier]:
                        # One dispatch for every range (see RestorePlan.run); ``cat`` into the
                        # chunk took 1.35x as long as this at 3.8 MiB.
                        torch._foreach_copy_([p.view() for p in pieces], [buffer[s:e] for s, e in ranges])
                    else:
                        for p in pieces:
                            p.view().copy_(buffer[p.start:p.end], non_blocking=True)
                    # The digest thread reads these bytes on the CPU, from its own stream: on a GPU
                    # it waits for this one's copies (a caller's stream need not be the default one).
                    chunk.copied_from(buffer.device)
                    register(pieces)
            except BaseException:
                if record is None and chunk is not None:   # nothing holds it: a failed snapshot keeps no bytes
                    self._free(chunk)
                raise
            finally:
                # Queued once the bytes are all there, as the digest job reads them; also when
                # the call is interrupted after the copy (a Ctrl-C is raised as the C call
                # returns), or the record would keep an empty digest and a hold never released.
                if record is not None:
                    self.digests.submit(record, list(record.pieces))
            self._emit("snapshot", record.info)
        return record

    def fork(self, source: Record, name: str | None) -> Record:
        """A new capsule with the same bytes as ``source``: metadata only, every chunk shared.
        Same bytes, same digest: one the source has already is taken over, not hashed again."""
        name = check_name(name)
        with self._held:
            if name and any(r.info.name == name for r in self._records.values()):
                raise InvalidCapsuleRequest(f"capsule name {name!r} is already used")
            source.last_used = time.monotonic()   # in use: the room the fork needs must not cost it
            chunk: Chunk | None = None
            record: Record | None = None
            known = (source.info.digest, source.info.history_hash) if _digest_final(source) else None
            try:
                if source.info.tier == "disk":
                    data, ranges = self._read_disk(source)
                    chunk = self._allocate("host", data.numel(), spare=source)
                    chunk.data.copy_(data)
                    pieces, tier, nbytes = _pieces_over(chunk, ranges), "host", data.numel()
                else:
                    pieces, tier, nbytes = list(source.pieces), source.info.tier, 0
                record = self._register(pieces, source.info.position, name, tier, False, source.info.id, nbytes,
                                        source.log, known=known)
            except BaseException:   # a Ctrl-C included: a fork that failed keeps no host bytes
                if record is None and chunk is not None:
                    self._free(chunk)
                raise
            if known is None:
                self.digests.submit(record, list(pieces))
            self._emit("fork", record.info)
        return record

    # ---- restore ---------------------------------------------------------------------------------
    def shared_rows(self, record: Record, other: Record, rows: int) -> int:
        """How many of the first ``rows`` per-token rows ``record`` keeps in the very bytes
        ``other`` keeps them in: a fork shares them all, and a snapshot that extended
        ``other`` shares its prefix. Chunks are immutable, so equal bytes follow."""
        with self._held:
            for offset, row_bytes in self.layout.rows:
                if rows:
                    same = _same_bytes_until(record.pieces, other.pieces, offset, offset + rows * row_bytes)
                    rows = min(rows, (same - offset) // row_bytes)
            return rows

    def check_compatible(self, capsule: Record | CapsuleInfo) -> None:
        """FingerprintMismatch unless the capsule was taken from this model and arena layout."""
        info = capsule.info if isinstance(capsule, Record) else capsule
        if info.model_fingerprint != self.model_fingerprint:
            raise FingerprintMismatch(
                f"capsule {info.id} was taken from model {info.model_fingerprint}, this engine runs "
                f"{self.model_fingerprint}")
        if info.layout_fingerprint != self.layout.fingerprint:
            raise FingerprintMismatch(
                f"capsule {info.id} has arena layout {info.layout_fingerprint}, this engine has "
                f"{self.layout.fingerprint} (other max_seq_len, dtype or model shape)")

    def verify(self, record: Record) -> None:
        """Re-hash the capsule's stored bytes; CorruptCapsule if they no longer match its digest."""
        with self._held:  # held throughout: a drop meanwhile would free, and a snapshot reuse, the bytes
            self.digests.finish(record)
            if record.info.tier == "disk":
                self._read_disk(record)  # verifies on read
                return
            actual = state_digest(self.layout.regions, record.info.position, lambda s, e: self._read(record, s, e))
        if actual != record.info.digest:
            raise CorruptCapsule(f"capsule {record.info.id}: stored bytes no longer match its digest")

    def write_back(self, record: Record, buffer: torch.Tensor, groups: Sequence[str] | None = None,
                   keep_rows: int = 0,
                   during: Callable[[torch.Tensor, Chunk | None], None] | None = None) -> tuple[torch.Tensor, Chunk | None]:
        """Copy the capsule's bytes (only ``groups``, when given) into ``buffer``.

        ``keep_rows``: the per-token rows [0:keep_rows] of ``buffer`` hold this
        capsule's bytes already (the live state descends from it), so they are
        not copied again.

        Everything that can fail (reading and verifying a disk capsule) happens
        before the first byte of ``buffer`` changes. Returns a view of the
        capsule's fixed-size block and the chunk it lives in (None if it belongs
        to nobody), so rollback can start from it without a copy; a
        ``before_free`` hook hears about the chunk before its memory is reused.
        ``during``: called with those two while the bytes copy (on a CPU; see
        ``RestorePlan.run``): the caller's own bookkeeping, hidden behind the copy.
        """
        with self._held:
            if groups is None and record.info.tier != "disk":
                plan = record.restore_plan(buffer, self.layout, keep_rows)
            else:  # one-off plans: a disk capsule's bytes are read afresh, a group restore is an ablation
                if record.info.tier == "disk":
                    data, ranges = self._read_disk(record)
                    pieces = _pieces_over(Chunk.holding("disk", data), ranges)
                else:
                    pieces = record.pieces
                wanted = (self.layout.group_ranges(record.info.position, groups) if groups is not None
                          else self.layout.ranges(record.info.position, min(keep_rows, record.info.position)))
                plan = RestorePlan(pieces, wanted, buffer, self.layout.fixed_bytes)
            plan.run(None if during is None else lambda: during(plan.fixed, plan.fixed_owner))
            record.last_used = time.monotonic()
            return plan.fixed, plan.fixed_owner

    # ---- internals -------------------------------------------------------------------------------
    def _register(self, pieces: list[Piece], position: int, name: str, tier: str, pin: bool, parent: str,
                  nbytes: int, log_runs: tuple, known: tuple[str, str] | None = None) -> Record:
        """``known``: the (digest, history hash) of these very bytes, when already computed.
        Otherwise the record's digest job holds its chunks too, and the caller submits that
        job (``digests.submit``) once the bytes are all there."""
        digest, history = known or ("", "")
        # Positional, in field order: keywords cost a cold snapshot several microseconds.
        info = CapsuleInfo(self._new_id(), name, parent, position, nbytes, tier, bool(pin), time.time(),
                           self.model_fingerprint, self.layout.fingerprint, digest, history, self.layout.table)
        # Two holds per chunk while a digest is pending: the record's, and its digest job's
        # (which keeps the chunks alive if the capsule is dropped before it is hashed).
        holds, held = 1 if known else 2, []
        try:
            for chunk in _chunks(pieces):
                chunk.refs += holds
                held.append(chunk)
            record = Record(info, pieces, log_runs)
            self._records[info.id] = record
        except BaseException:
            # A Ctrl-C lands between two bytecodes: the holds taken so far would keep a base's
            # shared chunks, which no record names, alive (and counted) for good.
            self._records.pop(info.id, None)
            for chunk in held:
                chunk.refs -= holds
            raise
        return record

    def _release(self, pieces: list[Piece]) -> None:
        for chunk in _chunks(pieces):
            chunk.refs -= 1
            if chunk.refs == 0:
                self._free(chunk)

    def _free(self, chunk: Chunk) -> None:
        self._used[chunk.tier] -= chunk.nbytes
        for hook in self.before_free:
            hook(chunk)
        if chunk.tier == "device":
            self.pool.release(chunk)

    def close(self) -> None:
        """Stop the digest thread once its queue is done and forget every capsule held in
        memory (disk files stay). The store is unusable afterwards."""
        self.digests.close()  # the caller must not hold the lock: the worker takes it to release
        with self._held:
            for record in list(self._records.values()):
                self._release(record.pieces)
                record.pieces = []
            self._records.clear()

    def _compute_digest(self, record: Record, pieces: list[Piece]) -> None:
        """On the digest thread, from the pieces the job holds (a drop empties record.pieces)."""
        read = lambda s, e: self._read(record, s, e, pieces)  # noqa: E731
        digest = state_digest(self.layout.regions, record.info.position, read)
        history = history_digest(self.layout.regions, record.info.position, read)
        # Only _demote also replaces info, and it finishes the job first.
        record.info = record.info._replace(digest=digest, history_hash=history)

    def _announce_digest(self, record: Record) -> None:
        """After the digest job is over: not for a capsule dropped before its hash was done."""
        with self._held:   # else a drop could slip in between the check and the event
            if record.info.digest and self.keeps(record):
                self._emit("digest", record.info)

    def _read(self, record: Record, start: int, end: int, pieces: list[Piece] | None = None):
        covering = record.pieces_in(start, end) if pieces is None else _slice(pieces, start, end)
        parts = [p.chunk.readable(p.offset, p.end - p.start) for p in covering]
        if sum(p.size for p in parts) != end - start:
            raise CorruptCapsule(f"capsule {record.info.id} does not cover arena bytes [{start}, {end})")
        return parts

    def _new_id(self) -> str:
        # 64 random bits, as secrets.token_hex(8) gives, from a generator seeded from os.urandom
        # (at start and in a forked child): no system call on the snapshot path (15-20 us cold).
        # Made 64 at a time: one id drawn and formatted from a cold cache cost 15 us, a pop 1.
        if not self._id_stock:
            self._id_stock = [f"{self._ids.getrandbits(64):016x}" for _ in range(64)]
        return self._id_stock.pop()

    def _new_ids(self) -> None:
        """Forget the ids made ahead and seed the generator afresh (in a forked child)."""
        self._ids.seed()
        self._id_stock = []

    def _address_of(self, buffer: torch.Tensor) -> int:
        """The arena buffer's address (checked once: the engine passes the same buffer)."""
        if self._buffer is None or self._buffer[0] is not buffer:
            self._buffer = (buffer, span_copy.address_of(buffer, self.layout.nbytes))
        return self._buffer[1]

    def _allocate(self, tier: str, nbytes: int, spare: Record | None = None) -> Chunk:
        """A chunk of ``nbytes`` on ``tier``, spilling to make room: never ``spare``, also not
        when a spill makes room in the tier below in turn."""
        # The pool is the device budget: a chunk that fits needs no room made first (and this
        # path, every snapshot's, one call fewer from a cold cache).
        chunk = self.pool.allocate(nbytes) if tier == "device" else None
        if chunk is None:
            if spare is not None:
                self._spared.append(spare)
            try:
                self._make_room(tier, nbytes)
            finally:
                if spare is not None:
                    self._spared.pop()
            chunk = self.pool.allocate(nbytes) if tier == "device" else host_chunk(nbytes, self._pin_host)
            if chunk is None:
                raise BudgetExceeded(f"device tier: no {nbytes} contiguous bytes left in the pool")
        self._used[tier] += chunk.nbytes
        return chunk

    def _fits(self, tier: str, nbytes: int) -> bool:
        if tier == "device":
            return self.pool.largest_free() >= self.pool.footprint(nbytes)
        return self._used[tier] + nbytes <= self._budgets.get(tier, 0)

    def _make_room(self, tier: str, nbytes: int) -> None:
        victims = self._victims(tier, nbytes)
        for victim in victims:
            if self._fits(tier, nbytes):
                return
            self._demote(victim)
        if not self._fits(tier, nbytes):
            raise BudgetExceeded(
                f"{tier} tier: {nbytes} bytes do not fit even after spilling every unpinned capsule "
                f"({self._used[tier]} of {self._budgets.get(tier, 0)} used)")

    def _victims(self, tier: str, nbytes: int) -> list[Record]:
        """The capsules to move down, least recently used first, for ``nbytes`` to fit in
        ``tier`` ([] if they fit already). BudgetExceeded, before anything moves, if even
        all of them would not make room."""
        if self._fits(tier, nbytes):
            return []
        budget = self._budgets.get(tier, 0)
        # The pool rounds chunks up: compare what the chunk would take, or every capsule is
        # spilled for one that can never fit.
        footprint = self.pool.footprint(nbytes) if tier == "device" else nbytes
        if footprint > budget:
            raise BudgetExceeded(f"{tier} tier: a {nbytes}-byte capsule exceeds the whole budget of {budget} bytes")
        if not self.spill:
            raise BudgetExceeded(
                f"{tier} tier: {nbytes} more bytes exceed the budget ({self._used[tier]} of {budget} used); "
                f"spill is off")
        victims = sorted((r for r in self._records.values()
                          if r.info.tier == tier and not r.info.pinned
                          and not any(r is s for s in self._spared)),
                         key=lambda r: r.last_used)
        if not self._fits_without(tier, nbytes, victims):   # refuse before a single capsule moves
            raise BudgetExceeded(
                f"{tier} tier: {nbytes} bytes would not fit even after spilling every unpinned capsule "
                f"({self._used[tier]} of {budget} used; pinned capsules and those sharing their bytes stay)")
        return victims

    def _fits_without(self, tier: str, nbytes: int, victims: list[Record]) -> bool:
        """Whether ``nbytes`` would fit once every victim had left the tier: a chunk is freed
        only if the victims (and their digest jobs) hold every reference to it."""
        if tier == "disk":   # a disk capsule's bytes are its own file
            return self._used[tier] - sum(v.info.nbytes for v in victims) + nbytes <= self._budgets.get(tier, 0)
        held: dict[int, int] = {}
        chunks: dict[int, Chunk] = {}
        for victim in victims:
            # One hold per chunk for the record, one more for its digest job until settled.
            holders = [victim.pieces] + ([victim.job.pieces] if victim.job and victim.job.state != SETTLED else [])
            for pieces in holders:
                for chunk in _chunks(pieces):
                    chunks[id(chunk)] = chunk
                    held[id(chunk)] = held.get(id(chunk), 0) + 1
        freed = [c for key, c in chunks.items() if held[key] == c.refs]
        if tier == "device":
            return self.pool.largest_free_after(freed) >= self.pool.footprint(nbytes)
        return self._used[tier] - sum(c.nbytes for c in freed) + nbytes <= self._budgets.get(tier, 0)

    def _demote(self, record: Record) -> None:
        """Move a capsule one tier down (device -> host -> disk), or drop it from the last tier.

        A capsule the tier below cannot take (pinned capsules fill it, or its budget is 0)
        is dropped too, as from the last tier: the room was promised by _victims, and a
        request must not fail half-way with some capsules moved."""
        lower = _LOWER[record.info.tier]
        if lower is None or (lower == "disk" and self.dir is None):
            self._evict(record)
            return
        self.digests.finish(record)  # the digest first, and the job's hold on the old tier ends now
        for p in record.pieces:
            p.chunk.wait()
        data = torch.cat([p.view().cpu() for p in record.pieces]) if record.pieces else None
        ranges = [(p.start, p.end) for p in record.pieces]
        old = record.pieces
        try:
            if lower == "host":
                chunk = self._allocate("host", data.numel())
                chunk.data.copy_(data)
                chunk.refs += 1
                record.pieces = _pieces_over(chunk, ranges)
                record.info = record.info._replace(tier="host", nbytes=data.numel())
            else:
                # On disk a capsule holds all of its bytes: the header must say so, since a
                # restart counts the disk tier from the headers.
                info = record.info._replace(tier="disk", nbytes=data.numel())
                record.path = self._write_disk(info, ranges, data, record.log)
                record.pieces = []
                record.info = record.file_info = info
        except BudgetExceeded:
            self._evict(record)
            return
        self._release(old)
        self._emit("spill", record.info)

    def _evict(self, record: Record) -> None:
        self._remove(record)
        self._emit("evict", record.info)

    def _remove(self, record: Record, unlink: bool = True) -> None:
        del self._records[record.info.id]
        self.digests.settle(record)
        self._release(record.pieces)
        record.pieces = []
        if record.path is not None:
            self._used["disk"] -= record.info.nbytes
            try:
                if unlink:
                    diskformat.remove(record.path)
            except OSError as exc:   # an eviction goes on: the room is counted, the file may come back
                log.warning("capsule %s evicted, but its file stays: %s", record.info.id, exc.strerror or exc)

    def _emit(self, kind: str, info: CapsuleInfo) -> None:
        """Called with the lock held: the event goes out when the outermost hold ends."""
        assert self._held.depth > 0, "a capsule event raised outside the store's lock would wait for the next call"
        self._held.events.append((kind, info))

    def _deliver(self, kind: str, info: CapsuleInfo) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, info)
            except Exception:  # a listener must not break the store
                log.exception("capsule event listener failed")

    # ---- disk tier -------------------------------------------------------------------------------
    def _require_dir(self) -> Path:
        if self.dir is None:
            raise InvalidCapsuleRequest("the disk tier needs a capsule_dir")
        return self.dir

    def _capture_disk(self, buffer: torch.Tensor, position: int, name: str, pin: bool, parent: str,
                      log_runs: tuple) -> Record:
        self._require_dir()
        ranges = self.layout.ranges(position)
        data = torch.cat([buffer[s:e].cpu() for s, e in ranges])
        info = CapsuleInfo(
            id=self._new_id(), name=name, parent=parent, position=position, nbytes=data.numel(), tier="disk",
            pinned=bool(pin), created=time.time(), model_fingerprint=self.model_fingerprint,
            layout_fingerprint=self.layout.fingerprint, digest="", history_hash="", region_table=self.layout.table)
        read = disk_capsules.range_reader(ranges, data)
        info = info._replace(digest=state_digest(self.layout.regions, position, read),
                             history_hash=history_digest(self.layout.regions, position, read))
        path = self._write_disk(info, ranges, data, log_runs)
        record = Record(info, [], log_runs, path)
        self._records[info.id] = record
        self._emit("snapshot", info)
        return record

    def _write_disk(self, info: CapsuleInfo, ranges: list[tuple[int, int]], data: torch.Tensor,
                    log_runs: tuple) -> Path:
        folder = self._require_dir()
        self._victims("disk", data.numel())   # refused here, nothing written or evicted yet
        path = diskformat.path_for(folder, info.id)
        diskformat.write(path, disk_capsules.header_for(info, ranges, log_runs), data, self._key)
        try:
            # Older capsules leave only once the new one is safely on disk: a failed write
            # (a full disk) must not have cost them.
            self._make_room("disk", data.numel())
        except BaseException:
            try:
                diskformat.remove(path)
            except OSError as exc:   # the refusal stands; the file may come back at the next start
                log.warning("capsule file %s left behind after a refused write: %s", path.name, exc.strerror or exc)
            raise
        self._used["disk"] += data.numel()
        return path

    def _read_disk(self, record: Record) -> tuple[torch.Tensor, list[tuple[int, int]]]:
        """Read and verify a disk capsule's bytes before anyone uses them: the same checks as at
        start, and the file must still describe the capsule it did then."""
        capsule = disk_capsules.reread(record.path, record.file_info, record.log, self.layout, self.log_kinds,
                                       self._key)
        self.check_compatible(capsule.info)
        return capsule.data, capsule.ranges

    def _load_disk(self) -> None:
        folder = self.dir
        try:
            folder.mkdir(parents=True, exist_ok=True)
            stale_files = diskformat.stale_temp_files(folder)
            files = sorted(folder.glob(f"*{diskformat.SUFFIX}"))
        except OSError as exc:
            raise CapsuleIOError(f"capsule_dir {folder}: {exc.strerror or exc}") from None
        for stale in stale_files:   # debris of an interrupted write: never a capsule
            try:
                stale.unlink(missing_ok=True)
            except OSError as exc:   # a read-only folder still serves its capsules
                log.warning("cannot remove %s, left by an interrupted write: %s", stale.name, exc.strerror or exc)
        loaded = []
        for path in files:
            try:
                capsule = disk_capsules.read(path, self.layout, self.log_kinds, self._key)
                self.check_compatible(capsule.info)
            except (CorruptCapsule, FingerprintMismatch, CapsuleIOError) as exc:
                log.warning("skipping capsule file %s: %s", path.name, exc)
                continue
            loaded.append(Record(capsule.info, [], capsule.log, path))
        now, names = time.time(), set()
        for record in sorted(loaded, key=lambda r: r.info.created):
            info = record.info
            if info.name and info.name in names:   # two engines shared the folder: the older one keeps it
                log.warning("capsule file %s: name %r is taken by an older capsule; loaded without a name "
                            "(its id still reaches it)", record.path.name, info.name)
                info = record.info = info._replace(name="")
            names.add(info.name)
            # Least recently used first, across a restart too: by age.
            record.last_used = time.monotonic() - max(0.0, now - info.created)
            self._records[info.id] = record
            self._used["disk"] += info.nbytes


def _digest_final(record: Record) -> bool:
    """Whether the record's digest is computed (a failed hash leaves it empty)."""
    return (record.job is None or record.job.state in (FINISHED, SETTLED)) and record.info.digest != ""


def _chunks(pieces: list[Piece]) -> Iterable[Chunk]:
    """The chunks ``pieces`` lie in, each once, in order (Chunk has no __eq__: by identity).
    Linear: a capsule at the end of a chain of snapshots, each sharing its base's rows, has up
    to SHARE_PIECES pieces over a third as many chunks. A plain loop: from a cold cache
    dict.fromkeys over a map took 9 us more for a snapshot's three pieces."""
    seen: dict[Chunk, None] = {}
    for p in pieces:
        seen[p.chunk] = None
    return seen


def _pieces_over(chunk: Chunk, ranges: Sequence[tuple[int, int]]) -> list[Piece]:
    """Pieces for ``ranges`` laid end to end in ``chunk``."""
    pieces, offset = [], 0
    for s, e in ranges:
        pieces.append(Piece(s, e, chunk, offset))
        offset += e - s
    return pieces
