"""The capsule store: capsules in three tiers, with budgets, LRU spill, sharing and integrity.

A capsule is a list of pieces, each mapping an arena byte range onto bytes of a chunk. Chunks
are immutable and reference-counted, so a fork or a snapshot that extends an earlier capsule's
token prefix points at the earlier chunk instead of copying it: N branches of a P-token prefix
cost about P + N * delta bytes. The store is bookkeeping: for a snapshot or a restore it hands
the engine a plan (``plans``), the byte copies and what they make, and the engine carries it
out. The disk tier's files are ``disk_capsules.CapsuleFolder``'s. Digests are computed off the
snapshot path by one background thread, from the capsule's own immutable copy.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from ..digest import history_digest, state_digest
from ..errors import shown
from . import diskformat
from .digest_queue import FINISHED, SETTLED, DigestQueue
from .disk_capsules import CapsuleFolder, range_reader
from .errors import BudgetExceeded, CapsuleIOError, CorruptCapsule, InvalidCapsuleRequest, UnknownCapsule
from .held_events import HeldEvents, Lockable
from .info import TIERS, CapsuleInfo, check_budgets, check_compatible, check_name, check_tier
from .layout import Layout
from .memory import Chunk, DevicePool, host_chunk
from .pieces import Piece, Record, chunks_of, cut, laid_out, same_bytes_until
from .plans import RestorePlan, SnapshotPlan

log = logging.getLogger(__name__)

_LOWER = {"device": "host", "host": "disk", "disk": None}
# A snapshot shares its base's token rows only while the base lies in at most this many pieces:
# each snapshot of a chain (one per step, each extending the last) adds a piece per per-token
# region, so past the bound the rows are copied whole and the chain starts over, and no
# snapshot's bookkeeping grows with the chain.
SHARE_PIECES = 64


class CapsuleStore:
    """Capsules by id and name; ``used_bytes`` and ``budget_bytes`` per tier."""

    def __init__(self, layout: Layout, model_fingerprint: str, device: torch.device,
                 budgets: dict[str, int], spill: bool, capsule_dir: str | Path | None,
                 on_event: Callable[[str, CapsuleInfo], None] | None = None,
                 lock: Lockable | None = None, log_kinds: Iterable[str] = (), key: bytes | None = None) -> None:
        """``key``: sign every capsule file written, and refuse any read without a valid
        signature (``signing``); None: files carry digests only."""
        self._budgets = check_budgets(budgets)
        self.layout, self.model_fingerprint, self.device = layout, model_fingerprint, device
        self.log_kinds = frozenset(log_kinds)   # boundary kinds the engine can replay
        self._key = key
        self.spill = spill
        self._used = {t: 0 for t in TIERS}
        self._records: dict[str, Record] = {}
        # Capsules the call in progress works from: no spill it sets off, however far down the
        # tiers it cascades, may move or evict them.
        self._spared: list[Record] = []
        # The engine passes its own lock: one lock orders every state change, the digest
        # thread's included.
        self._lock = lock or threading.RLock()
        self._held = HeldEvents(self._lock, self._deliver)
        self._listeners: list[Callable[[str, CapsuleInfo], None]] = [on_event] if on_event else []
        self._pin_host = device.type == "cuda"
        self.pool = DevicePool(self._budgets.get("device", 0), device)
        self.dir = Path(capsule_dir) if capsule_dir else None
        self._folder = (CapsuleFolder(self.dir, layout, self.log_kinds, model_fingerprint, key)
                        if self.dir is not None else None)
        self.digests = DigestQueue(self._compute_digest, self._release, self._lock, self._announce_digest)
        if self._folder is not None:
            for record in self._folder.load():
                self._records[record.info.id] = record
                self._used["disk"] += record.info.nbytes

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

    def kept(self, capsule_id: str) -> Record | None:
        """The capsule with this id, if the store still holds it."""
        with self._held:
            return self._records.get(capsule_id)

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
    def plan_snapshot(self, position: int, *, name: str | None, tier: str, pin: bool, parent: str,
                      base: tuple[str, int] | None, log_runs: tuple) -> SnapshotPlan:
        """The memory for a capsule of the live state at ``position``, allocated (spilling
        others to make room), with the copies that fill it. Nothing is registered until
        ``add``; ``discard`` gives the memory back.

        ``base`` = (capsule id, p): the live per-token rows [0:p] are byte-equal to that
        capsule's, so they are referenced instead of copied while the store still holds it.
        """
        name = check_name(name)
        check_tier(tier)
        with self._held:
            if name and any(r.info.name == name for r in self._records.values()):
                raise InvalidCapsuleRequest(f"capsule name {name!r} is already used")
            if tier == "disk":
                self._require_folder()
            source = self._records.get(base[0]) if base else None
            shared, start = self._shared_prefix(source, base[1] if base else 0, tier, position)
            nbytes = self.layout.ranges_bytes(position, start)
            if tier == "disk":   # a staging buffer: the bytes are counted once they are in their file
                chunk = Chunk.holding("disk", torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin_host))
            else:
                try:
                    # Room is made without spilling the base: that would free the very rows shared here.
                    chunk = self._allocate(tier, nbytes, spare=source if shared else None)
                except BudgetExceeded:
                    if not shared:
                        raise
                    shared, start = [], 0   # copy it all; the base may go
                    nbytes = self.layout.ranges_bytes(position)
                    chunk = self._allocate(tier, nbytes)
            ranges = self.layout.ranges(position, start)
            info = CapsuleInfo(id="", name=name, parent=parent, position=position, nbytes=nbytes, tier=tier,
                               pinned=bool(pin), created=0.0, model_fingerprint=self.model_fingerprint,
                               layout_fingerprint=self.layout.fingerprint, digest="", history_hash="",
                               region_table=self.layout.table)
            return SnapshotPlan(info, log_runs, tier, chunk, ranges, laid_out(chunk, ranges), shared, nbytes)

    def add(self, plan: SnapshotPlan) -> Record:
        """The capsule of a snapshot plan whose copies are done. A disk capsule is written to its
        file here (CapsuleIOError if that fails; nothing is kept then)."""
        with self._held:
            if plan.added:
                raise InvalidCapsuleRequest("this snapshot plan is a capsule already")
            if plan.tier == "disk":
                record = self._add_disk(plan)
            else:
                pieces = sorted(plan.shared + plan.copied, key=lambda q: q.start) if plan.shared else plan.copied
                record = self._register(pieces, plan.info, plan.log)
                plan.added = True   # its chunk is the record's now, whatever comes next
                self.digests.submit(record, list(record.pieces))
            plan.added = True
            self._emit("snapshot", record.info)
        return record

    def operation(self) -> HeldEvents:
        """``with store.operation():`` around several calls that make one operation (a snapshot's
        plan, copy and add): the events they raise reach listeners once all of it is done."""
        return self._held

    def discard(self, plan: SnapshotPlan) -> None:
        """Give back the memory of a snapshot plan that did not become a capsule."""
        with self._held:
            if not plan.added and plan.tier != "disk":
                plan.added = True   # once only
                self._free(plan.chunk)

    def _shared_prefix(self, base: Record | None, rows: int, tier: str, position: int) -> tuple[list[Piece], int]:
        """The base capsule's pieces that hold the live per-token rows [0:p] (p <= ``rows``) a
        new capsule in ``tier`` can reference, and p (0: nothing shared)."""
        if base is None or base.info.tier != tier or tier == "disk" or len(base.pieces) > SHARE_PIECES:
            return [], 0
        start = min(rows, position)
        shared: list[Piece] = []
        if start:
            for r in self.layout.regions:
                if r.per_token:
                    shared += base.pieces_in(r.offset, r.offset + start * r.row_bytes)
        return shared, start

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
                    capsule = self._folder.reread(source)
                    chunk = self._allocate("host", capsule.data.numel(), spare=source)
                    chunk.data.copy_(capsule.data)
                    pieces, tier, nbytes = laid_out(chunk, capsule.ranges), "host", capsule.data.numel()
                else:
                    pieces, tier, nbytes = list(source.pieces), source.info.tier, 0
                info = source.info._replace(name=name, parent=source.info.id, nbytes=nbytes, tier=tier, pinned=False,
                                            digest=known[0] if known else "", history_hash=known[1] if known else "")
                record = self._register(pieces, info, source.log, final=known is not None)
            except BaseException:   # a Ctrl-C included: a fork that failed keeps no host bytes
                if record is None and chunk is not None:
                    self._free(chunk)
                raise
            if known is None:
                self.digests.submit(record, list(pieces))
            self._emit("fork", record.info)
        return record

    # ---- restore ---------------------------------------------------------------------------------
    def shared_rows(self, record: Record, other_id: str, rows: int) -> int:
        """How many of the first ``rows`` per-token rows ``record`` keeps in the very bytes the
        capsule ``other_id`` keeps them in (0 if the store no longer holds it): a fork shares
        them all, and a snapshot that extended the other shares its prefix. Chunks are
        immutable, so equal bytes follow."""
        with self._held:
            other = self._records.get(other_id)
            if other is None:
                return 0
            if other is record:
                return rows
            for offset, row_bytes in self.layout.rows:
                if rows:
                    same = same_bytes_until(record.pieces, other.pieces, offset, offset + rows * row_bytes)
                    rows = min(rows, (same - offset) // row_bytes)
            return rows

    def check_compatible(self, capsule: Record | CapsuleInfo) -> None:
        """FingerprintMismatch unless the capsule was taken from this model and arena layout."""
        info = capsule.info if isinstance(capsule, Record) else capsule
        check_compatible(info, self.model_fingerprint, self.layout.fingerprint)

    def verify(self, record: Record) -> None:
        """Re-hash the capsule's stored bytes; CorruptCapsule if they no longer match its digest."""
        with self._held:  # held throughout: a drop meanwhile would free, and a snapshot reuse, the bytes
            self.digests.finish(record)
            if record.info.tier == "disk":
                self._folder.reread(record)  # verifies on read
                return
            actual = state_digest(self.layout.ranges(record.info.position), lambda s, e: self._read(record, s, e))
        if actual != record.info.digest:
            raise CorruptCapsule(f"capsule {record.info.id}: stored bytes no longer match its digest")

    def plan_restore(self, record: Record, keep_rows: int = 0, groups: Sequence[str] | None = None) -> RestorePlan:
        """The copies that make the capsule's state (only ``groups``, when given) the arena's.

        ``keep_rows``: the arena's per-token rows [0:keep_rows] hold this capsule's bytes
        already (the live state descends from it), so they are not copied again. A disk
        capsule's file is read and verified here, into memory the plan owns.
        """
        with self._held:
            position = record.info.position
            if record.info.tier == "disk":
                capsule = self._folder.reread(record)
                pieces = laid_out(Chunk.holding("disk", capsule.data), capsule.ranges)
            else:
                pieces = record.pieces
            wanted = (self.layout.group_ranges(position, groups) if groups is not None
                      else self.layout.ranges(position, min(keep_rows, position)))
            record.last_used = time.monotonic()
            return RestorePlan(record, pieces, wanted)

    # ---- internals -------------------------------------------------------------------------------
    def _register(self, pieces: list[Piece], info: CapsuleInfo, log_runs: tuple, final: bool = False) -> Record:
        """A new capsule of ``info`` (its id and creation time made here) over ``pieces``.
        ``final``: its digest is known (a fork of a hashed capsule). Otherwise the record's
        digest job holds its chunks too, and the caller submits that job (``digests.submit``)."""
        info = info._replace(id=secrets.token_hex(8), created=time.time())
        # Two holds per chunk while a digest is pending: the record's, and its digest job's
        # (which keeps the chunks alive if the capsule is dropped before it is hashed).
        holds, held = 1 if final else 2, []
        try:
            for chunk in chunks_of(pieces):
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
        for chunk in chunks_of(pieces):
            chunk.refs -= 1
            if chunk.refs == 0:
                self._free(chunk)

    def _free(self, chunk: Chunk) -> None:
        self._used[chunk.tier] -= chunk.nbytes
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
        digest = state_digest(self.layout.ranges(record.info.position), read)
        history = history_digest(self.layout.regions, record.info.position, read)
        # Only _demote also replaces info, and it finishes the job first.
        record.info = record.info._replace(digest=digest, history_hash=history)

    def _announce_digest(self, record: Record) -> None:
        """After the digest job is over: not for a capsule dropped before its hash was done."""
        with self._held:   # else a drop could slip in between the check and the event
            if record.info.digest and self.keeps(record):
                self._emit("digest", record.info)

    def _read(self, record: Record, start: int, end: int, pieces: list[Piece] | None = None):
        covering = record.pieces_in(start, end) if pieces is None else cut(pieces, start, end)
        parts = [p.chunk.readable(p.offset, p.end - p.start) for p in covering]
        if sum(p.size for p in parts) != end - start:
            raise CorruptCapsule(f"capsule {record.info.id} does not cover arena bytes [{start}, {end})")
        return parts

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
                for chunk in chunks_of(pieces):
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
                record.pieces = laid_out(chunk, ranges)
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
    def _require_folder(self) -> CapsuleFolder:
        if self._folder is None:
            raise InvalidCapsuleRequest("the disk tier needs a capsule_dir")
        return self._folder

    def _add_disk(self, plan: SnapshotPlan) -> Record:
        plan.chunk.wait()
        read = range_reader(plan.ranges, plan.chunk.data)
        info = plan.info._replace(id=secrets.token_hex(8), created=time.time(),
                                  digest=state_digest(self.layout.ranges(plan.info.position), read),
                                  history_hash=history_digest(self.layout.regions, plan.info.position, read))
        path = self._write_disk(info, plan.ranges, plan.chunk.data, plan.log)
        record = Record(info, [], plan.log, path)
        self._records[info.id] = record
        return record

    def _write_disk(self, info: CapsuleInfo, ranges: list[tuple[int, int]], data: torch.Tensor,
                    log_runs: tuple) -> Path:
        folder = self._require_folder()
        self._victims("disk", data.numel())   # refused here, nothing written or evicted yet
        path = folder.write(info, ranges, data, log_runs)
        try:
            # Older capsules leave only once the new one is safely on disk: a failed write
            # (a full disk) must not have cost them.
            self._make_room("disk", data.numel())
        except BaseException:
            folder.discard(path)
            raise
        self._used["disk"] += data.numel()
        return path


def _digest_final(record: Record) -> bool:
    """Whether the record's digest is computed (a failed hash leaves it empty)."""
    return (record.job is None or record.job.state in (FINISHED, SETTLED)) and record.info.digest != ""
