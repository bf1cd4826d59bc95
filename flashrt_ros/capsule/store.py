"""The capsule store: capsules in three tiers, with budgets, LRU spill, sharing and integrity.

A capsule is a list of pieces, each mapping an arena byte range onto bytes of a chunk. Chunks
are immutable and reference-counted, so a fork or a snapshot that extends an earlier capsule's
token prefix points at the earlier chunk instead of copying it: N branches of a P-token prefix
cost about P + N * delta bytes. The store is bookkeeping: for a snapshot or a restore it hands
the engine a plan (``plans``), the byte copies and what they make, and the engine carries it
out. The disk tier's files are ``disk_capsules.CapsuleFolder``'s.

Records, tier bytes and events change under the store's lock only. Digests are hashed off the
snapshot path by a worker (``digest_worker``), started when the owner says a long step begins
(``start_digests``), that posts its results; the store collects them whenever it is entered, and at once where it needs a digest (``get``, ``verify``, a spill). A
capsule that leaves the store takes its job back from the queue, or waits for the one hash
running, so the worker never reads bytes no capsule holds, and the bytes a tier counts are
those of the capsules in it, whatever the worker is doing: budget decisions, and with them
refusals and evictions, are the same in a live run and in its replay. A digest, once
collected, is final.

Events (snapshot, fork, drop, spill, evict, digest, pull) are kept for the owner to take
(``take_events``), the latest ``EVENTS_KEPT`` of them.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
import weakref
from collections import deque
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..digest import history_digest, state_digest
from ..errors import shown
from . import diskformat
from .digest_worker import DigestJob, DigestWorker, Hashes
from .disk_capsules import CapsuleFolder, range_reader
from .errors import BudgetExceeded, CapsuleIOError, CorruptCapsule, InvalidCapsuleRequest, UnknownCapsule
from .fleet_chunks import Chunking
from .info import TIERS, CapsuleInfo, check_budgets, check_compatible, check_name, check_tier
from .layout import Layout
from .memory import Chunk, DevicePool, host_chunk
from .pieces import Piece, Record, chunks_of, laid_out, read_pieces, same_bytes_until
from .plans import RestorePlan, SnapshotPlan

log = logging.getLogger(__name__)

_LOWER = {"device": "host", "host": "disk", "disk": None}
# A snapshot shares its base's token rows only while the base lies in at most this many pieces:
# each snapshot of a chain (one per step, each extending the last) adds a piece per per-token
# region, so past the bound the rows are copied whole and the chain starts over, and no
# snapshot's bookkeeping grows with the chain.
SHARE_PIECES = 64
# Events an owner that never takes them leaves behind at most (the oldest go first).
EVENTS_KEPT = 1024


class CapsuleStore:
    """Capsules by id and name; ``used_bytes`` and ``budget_bytes`` per tier."""

    def __init__(self, layout: Layout, model_fingerprint: str, device: torch.device,
                 budgets: dict[str, int], spill: bool, capsule_dir: str | Path | None,
                 lock: AbstractContextManager | None = None, log_kinds: Iterable[str] = (),
                 key: bytes | None = None) -> None:
        """``lock``: a reentrant lock (the engine's own: one lock orders every state change).
        ``key``: sign every capsule file written, and refuse any read without a valid
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
        self._lock = lock or threading.RLock()
        self._events: deque[tuple[str, CapsuleInfo]] = deque(maxlen=EVENTS_KEPT)
        self._pin_host = device.type == "cuda"
        self.pool = DevicePool(self._budgets.get("device", 0), device)
        self.dir = Path(capsule_dir) if capsule_dir else None
        self._folder = (CapsuleFolder(self.dir, layout, self.log_kinds, model_fingerprint, key)
                        if self.dir is not None else None)
        self.digests = DigestWorker(layout)
        self._chunking: Chunking | None = None   # fleet chunks named beside each digest (``name_chunks``)
        # A store dropped unclosed stops its worker, which lets go of the jobs it holds.
        weakref.finalize(self, self.digests.stop)
        if self._folder is not None:
            for record in self._folder.load():
                self._records[record.info.id] = record
                self._used["disk"] += record.info.nbytes

    # ---- public queries ------------------------------------------------------------------------
    def take_events(self) -> list[tuple[str, CapsuleInfo]]:
        """The capsule events since the last take, oldest first, each (kind, info): snapshot,
        fork, drop, spill, evict, and digest once a capsule's background hash is collected
        (never after the capsule's drop or eviction). Taken under the lock, so each
        operation's events are all there or none. "pull": a capsule made elsewhere was added
        (``adopt``). Nothing pending: no turn of the lock, which the node asks for on every
        tick while decode steps queue for it."""
        if not self._events and not self.digests.posted:
            return []
        with self._lock:
            self._collect()
            events = list(self._events)
            self._events.clear()
        return events

    def start_digests(self) -> None:
        """Let the digest worker start on the capsules queued so far: the caller is about to
        run a long step, during which hashing costs its calls least (``digest_worker``)."""
        self.digests.wake()

    def name_chunks(self, chunking: Chunking | None) -> None:
        """From now on, hash each capsule made here in memory also chunk by chunk as
        ``chunking`` cuts it for the fleet tier (None: no more), in the same pass as its digest,
        off the snapshot path: a publish of it then sends at once (``chunk_names``). A disk
        snapshot, hashed on its own path, is not: a publish reads and verifies its file anyway."""
        with self._lock:
            self._chunking = chunking

    def chunk_names(self, ref: str | CapsuleInfo, chunking: Chunking) -> tuple[str, ...] | None:
        """The names of the capsule's fleet chunks as ``chunking`` cuts it, if they were hashed
        with its digest; None if not (or if the store no longer holds it)."""
        with self._lock:
            try:
                record = self.resolve(ref)
            except UnknownCapsule:
                return None
            self._finish(record)
            return record.wire[1] if record.wire is not None and record.wire[0] == chunking else None

    def list(self, tier: str | None = None) -> list[CapsuleInfo]:
        """Every capsule, or those of one tier (None or "" lists all)."""
        if tier not in (None, ""):
            check_tier(tier)
        with self._lock:
            self._collect()
            return [r.info for r in self._records.values() if tier in (None, "", r.info.tier)]

    def get(self, ref: str | CapsuleInfo, wait: bool = True) -> CapsuleInfo:
        """The capsule's info; with ``wait`` its digest is final (computed here if the digest
        worker has not started on it)."""
        with self._lock:  # one hold: a drop in between would leave a cancelled job's empty digest
            record = self.resolve(ref)
            if wait:
                self._finish(record)
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
        with self._lock:
            self._collect()
            record = self._records.get(key)
            if record is None:
                record = next((r for r in self._records.values() if r.info.name == key), None)
        if record is None:
            raise UnknownCapsule(f"no capsule with id or name {shown(key)}")
        return record

    def kept(self, capsule_id: str) -> Record | None:
        """The capsule with this id, if the store still holds it."""
        with self._lock:
            self._collect()
            return self._records.get(capsule_id)

    def drop(self, ref: str | CapsuleInfo) -> CapsuleInfo:
        with self._lock:
            record = self.resolve(ref)
            if record.path is not None:
                # The file first: one left behind would bring the capsule back at the next start.
                try:
                    diskformat.remove(record.path)
                except OSError as exc:
                    raise CapsuleIOError(f"cannot drop capsule {record.info.id}: {exc.strerror or exc}") from None
            self._remove(record, unlink=False)
            self._events.append(("drop", record.info))
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
        with self._lock:
            self._collect()
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
        with self._lock:
            self._collect()
            if plan.added:
                raise InvalidCapsuleRequest("this snapshot plan is a capsule already")
            if plan.tier == "disk":
                record = self._add_disk(plan)
            else:
                pieces = sorted(plan.shared + plan.copied, key=lambda q: q.start) if plan.shared else plan.copied
                record = self._register(pieces, plan.info, plan.log)
                plan.added = True   # its chunk is the record's now, whatever comes next
                self._submit(record)
            plan.added = True
            self._events.append(("snapshot", record.info))
        return record

    def discard(self, plan: SnapshotPlan) -> None:
        """Give back the memory of a snapshot plan that did not become a capsule."""
        with self._lock:
            self._collect()
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
        with self._lock:
            self._collect()
            if name and any(r.info.name == name for r in self._records.values()):
                raise InvalidCapsuleRequest(f"capsule name {name!r} is already used")
            source.last_used = time.monotonic()   # in use: the room the fork needs must not cost it
            chunk: Chunk | None = None
            record: Record | None = None
            final = source.job is None and source.info.digest != ""   # "" and no job: its hash failed
            try:
                if source.info.tier == "disk":
                    capsule = self._folder.reread(source)
                    chunk = self._allocate("host", capsule.data.numel(), spare=source)
                    chunk.data.copy_(capsule.data)
                    pieces, tier, nbytes = laid_out(chunk, capsule.ranges), "host", capsule.data.numel()
                else:
                    pieces, tier, nbytes = list(source.pieces), source.info.tier, 0
                info = source.info._replace(name=name, parent=source.info.id, nbytes=nbytes, tier=tier, pinned=False,
                                            digest=source.info.digest if final else "",
                                            history_hash=source.info.history_hash if final else "")
                record = self._register(pieces, info, source.log)
                record.wire = source.wire if final else None
            except BaseException:   # a Ctrl-C included: a fork that failed keeps no host bytes
                if record is None and chunk is not None:
                    self._free(chunk)
                raise
            if not final:
                self._submit(record)
            self._events.append(("fork", record.info))
        return record

    # ---- restore ---------------------------------------------------------------------------------
    def shared_rows(self, record: Record, other_id: str, rows: int) -> int:
        """How many of the first ``rows`` per-token rows ``record`` keeps in the very bytes the
        capsule ``other_id`` keeps them in (0 if the store no longer holds it): a fork shares
        them all, and a snapshot that extended the other shares its prefix. Chunks are
        immutable, so equal bytes follow."""
        with self._lock:
            self._collect()
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
        with self._lock:  # held throughout: a drop meanwhile would free, and a snapshot reuse, the bytes
            self._collect()
            self._finish(record)
            if record.info.tier == "disk":
                self._folder.reread(record)  # verifies on read
                return
            actual = state_digest(self.layout.ranges(record.info.position),
                                  lambda s, e: read_pieces(record.pieces, s, e))
        if actual != record.info.digest:
            raise CorruptCapsule(f"capsule {record.info.id}: stored bytes no longer match its digest")

    def plan_restore(self, record: Record, keep_rows: int = 0, groups: Sequence[str] | None = None) -> RestorePlan:
        """The copies that make the capsule's state (only ``groups``, when given) the arena's.

        ``keep_rows``: the arena's per-token rows [0:keep_rows] hold this capsule's bytes
        already (the live state descends from it), so they are not copied again. A disk
        capsule's file is read and verified here, into memory the plan owns.
        """
        with self._lock:
            self._collect()
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

    def close(self) -> None:
        """Stop the digest worker and forget every capsule held in memory (disk files stay).
        The store is unusable afterwards."""
        self.digests.close()
        with self._lock:
            for record in list(self._records.values()):
                self._release(record.pieces)
                record.pieces, record.job = [], None
            self._records.clear()

    # ---- capsules that come from or go to another place (the fleet tier) ------------------------
    def export(self, ref: str | CapsuleInfo) -> tuple[CapsuleInfo, tuple, torch.Tensor]:
        """The capsule's info (its digest final), its boundary log, and its data
        (``layout.ranges(position)`` end to end) in host memory, for the caller to read only.
        A view of the capsule's own bytes where they lie end to end in one host chunk (immutable,
        and kept alive by the view after a drop or a spill), else a copy made under the lock,
        so a drop meanwhile cannot free or reuse the bytes; either way the caller sends them
        wherever it likes without holding anything of the store's."""
        with self._lock:
            record = self.resolve(ref)
            self._finish(record)
            position = record.info.position
            if record.info.tier == "disk":
                data = self._folder.reread(record).data   # read, verified, and the caller's own
            elif (whole := self._host_view(record)) is not None:
                data = whole
            else:
                data = torch.empty(self.layout.ranges_bytes(position), dtype=torch.uint8)
                out, done = data.numpy(), 0
                for s, e in self.layout.ranges(position):
                    for part in read_pieces(record.pieces, s, e):
                        out[done:done + part.size] = part
                        done += part.size
            record.last_used = time.monotonic()
            return record.info, record.log, data

    def _host_view(self, record: Record) -> torch.Tensor | None:
        """The record's data as one view, if its pieces are its ranges laid end to end in one
        host chunk; None otherwise (rows in another chunk, as a snapshot that shares its base's
        rows has; a device pool chunk, which a release lets the pool hand out again)."""
        pieces = record.pieces
        if not pieces or pieces[0].chunk.tier != "host" or pieces[0].chunk.data.device.type != "cpu":
            return None
        chunk, base, done = pieces[0].chunk, pieces[0].offset, 0
        ranges = self.layout.ranges(record.info.position)
        if len(pieces) != len(ranges):
            return None
        for piece, (s, e) in zip(pieces, ranges):
            if piece.chunk is not chunk or (piece.start, piece.end, piece.offset) != (s, e, base + done):
                return None
            done += e - s
        chunk.wait()
        return chunk.data[base:base + done]

    def check_room(self, tier: str, nbytes: int) -> None:
        """BudgetExceeded now if ``tier`` cannot take ``nbytes`` more even after spilling (nothing
        moves): a caller about to fetch that many bytes from afar refuses before it fetches."""
        check_tier(tier)
        with self._lock:
            if tier == "disk":
                self._require_folder()
            self._victims(tier, nbytes)

    def adopt(self, info: CapsuleInfo, log_runs: tuple, data: torch.Tensor, tier: str) -> CapsuleInfo:
        """A capsule made elsewhere, added to ``tier`` under its own id. ``data``: host uint8,
        ``layout.ranges(info.position)`` end to end, which the caller has checked against
        ``info``'s digest and history hash, and hands over: on the host tier without pinning
        it becomes the capsule's own memory (no copy), so the caller must not change it after.
        The name is kept unless a capsule here has it.

        The same capsule held already (its id and digest) is returned as it is; another one
        under its id is refused. BudgetExceeded or CapsuleIOError leave nothing behind."""
        check_tier(tier)
        check_compatible(info, self.model_fingerprint, self.layout.fingerprint)
        nbytes = self.layout.ranges_bytes(info.position)
        if data.dtype != torch.uint8 or data.device.type != "cpu" or data.numel() != nbytes:
            raise InvalidCapsuleRequest(f"capsule {info.id}: {data.numel()} {data.dtype} bytes on {data.device}, a "
                                        f"capsule at position {info.position} is {nbytes} uint8 bytes on the host")
        with self._lock:
            self._collect()
            held = self._records.get(info.id)
            if held is not None:
                self._finish(held)
                if held.info.digest != info.digest:
                    raise InvalidCapsuleRequest(f"capsule id {info.id} is held here by a capsule with other bytes")
                held.last_used = time.monotonic()
                return held.info
            if info.name and any(r.info.name == info.name for r in self._records.values()):
                info = info._replace(name="")
            info = info._replace(tier=tier, nbytes=nbytes, pinned=False)
            ranges = self.layout.ranges(info.position)
            if tier == "disk":
                record = Record(info, [], log_runs, self._write_disk(info, ranges, data, log_runs))
            else:
                if tier == "host" and not self._pin_host:
                    self._make_room("host", nbytes)
                    chunk = Chunk.holding("host", data)
                    self._used["host"] += nbytes
                else:
                    chunk = self._allocate(tier, nbytes)
                try:
                    if chunk.data is not data:
                        chunk.data.copy_(data)
                    record = Record(info, laid_out(chunk, ranges), log_runs)
                except BaseException:
                    self._free(chunk)
                    raise
                chunk.refs += 1
            self._records[info.id] = record
            self._events.append(("pull", record.info))
            return record.info

    # ---- digests ---------------------------------------------------------------------------------
    def _submit(self, record: Record) -> None:
        record.job = DigestJob(record.info.id, record.info.position, list(record.pieces), self._chunking)
        self.digests.submit(record.job)

    def _collect(self) -> None:
        """The digests the worker posted, onto the capsules still waiting for them."""
        if self.digests.posted:
            for job, hashes in self.digests.take_posted():
                record = self._records.get(job.capsule_id)
                if record is not None and record.job is job:   # else the capsule left, and its job with it
                    self._settle(record, hashes)

    def _finish(self, record: Record) -> None:
        """The record's digest final now (hashed here, or waited for: one hash at most)."""
        if record.job is not None:
            self._settle(record, self.digests.result(record.job))

    def _settle(self, record: Record, hashes: Hashes) -> None:
        record.job = None
        if hashes.digest:   # "": the hash failed (logged); the capsule stays, with no digest to verify
            record.info = record.info._replace(digest=hashes.digest, history_hash=hashes.history)
            if hashes.chunking is not None:
                record.wire = (hashes.chunking, hashes.chunks)
            self._events.append(("digest", record.info))

    # ---- bytes and tiers -------------------------------------------------------------------------
    def _register(self, pieces: list[Piece], info: CapsuleInfo, log_runs: tuple) -> Record:
        """A new capsule of ``info`` (its id and creation time made here) over ``pieces``."""
        info = info._replace(id=secrets.token_hex(8), created=time.time())
        held = []
        try:
            for chunk in chunks_of(pieces):
                chunk.refs += 1
                held.append(chunk)
            record = Record(info, pieces, log_runs)
            self._records[info.id] = record
        except BaseException:
            # A Ctrl-C lands between two bytecodes: the holds taken so far would keep a base's
            # shared chunks, which no record names, alive (and counted) for good.
            self._records.pop(info.id, None)
            for chunk in held:
                chunk.refs -= 1
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
        only if the victims hold every reference to it."""
        if tier == "disk":   # a disk capsule's bytes are its own file
            return self._used[tier] - sum(v.info.nbytes for v in victims) + nbytes <= self._budgets.get(tier, 0)
        held: dict[int, int] = {}
        chunks: dict[int, Chunk] = {}
        for victim in victims:
            for chunk in chunks_of(victim.pieces):
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
        self._finish(record)  # the digest first, of the bytes on the old tier
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
        self._events.append(("spill", record.info))

    def _evict(self, record: Record) -> None:
        self._remove(record)
        self._events.append(("evict", record.info))

    def _remove(self, record: Record, unlink: bool = True) -> None:
        del self._records[record.info.id]
        if record.job is not None:   # the worker must not read the bytes released next
            self.digests.cancel(record.job)
            record.job = None
        self._release(record.pieces)
        record.pieces = []
        if record.path is not None:
            self._used["disk"] -= record.info.nbytes
            try:
                if unlink:
                    diskformat.remove(record.path)
            except OSError as exc:   # an eviction goes on: the room is counted, the file may come back
                log.warning("capsule %s evicted, but its file stays: %s", record.info.id, exc.strerror or exc)

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
