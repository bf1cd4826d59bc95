"""The fleet tier: capsules on a Valkey or Redis server a fleet already runs, shared by
robots and servers, content-addressed and signed.

``FleetTier(url, key, prefix)`` publishes a capsule of a local store (``publish``), pulls one
into a local tier (``pull``: verified whole before the store sees a byte, then served locally),
lists them (``list``), holds or drops this node's reference (``hold``, ``drop``), and collects
the chunks no manifest names (``collect``). It never touches an engine's live state: a restore
or fork from a pulled capsule goes through the engine as for any local capsule.

What is on the server, and why it is safe while other nodes publish, pull and collect:
``fleet_config.FleetKeys`` (the keys), ``fleet_chunks`` (the cut), ``fleet_manifest`` (the
signed manifest), ``fleet_scripts`` (the atomic steps and their invariants); docs/fleet.md.

Publish: the capsule's bytes are read out of the store (``CapsuleStore.export``: a view of
its immutable host bytes, or a copy) and cut into chunks named by their digests (named when
the store hashed the capsule, where ``prepare`` asked it to, else here; not checked against
the capsule digest here: every reader checks them); its chunks are touched (marked
in use now), the missing ones sent with SET NX in pipelined batches, and the manifest written
last by a script that writes it only if every chunk is there and freshly touched. A publish
that dies half-way leaves chunks no manifest names, which expire or are collected; never a
manifest without its chunks.

Pull: the manifest is read and checked (signature, fingerprints, every header field, the
cut), the chunks fetched in pipelined batches and read off the socket straight into memory
this process allocates (``fleet_receive``), each checked against its length and hashed in
order as the batches come, then the whole against
the capsule digest and history hash (a chunk altered fails the capsule digest, and is then
found, named, and removed from the server, where it would keep every capsule that shares it
from restoring); only then does the store take the bytes (``CapsuleStore.adopt``). Anything
missing or altered is refused whole.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import redis
import torch

from ..digest import history_digest, state_hasher
from ..errors import shown
from ..hugepages import populate
from . import fleet_manifest, signing
from .disk_capsules import range_reader
from .errors import (BudgetExceeded, CapsuleError, CapsuleIOError, CorruptCapsule, FleetUnavailable,
                     IncompleteCapsule, InvalidCapsuleRequest, UnknownCapsule)
from .fleet_chunks import Chunking, Span, chunk_bytes, chunking_for, digest, length, wire_chunks
from .fleet_config import FleetConfig, FleetKeys
from .fleet_receive import get_into
from .fleet_scripts import Scripts, outcome
from .info import CapsuleInfo, check_name, check_tier, is_capsule_id
from .layout import Layout
from .store import CapsuleStore

log = logging.getLogger(__name__)

# A publish whose chunks vanish between its touch and its commit (evicted under maxmemory, or
# collected after a publish slower than the grace) touches and sends again, this many times.
PUBLISH_ATTEMPTS = 3
# A pull cuts its chunks into at least this many batches (``FleetTier.pull_batch_bytes``).
PULL_BATCHES = 4
_COLLECT_BATCH = 256   # chunks per collecting script: each is atomic, so it blocks the server briefly
_SCAN_COUNT = 500


class FleetCapsule(NamedTuple):
    """A capsule in the fleet tier as ``list`` shows it. ``info``: tier "fleet", its name
    the first of ``names`` (the names pointing at it) or "". ``expires_in_s``: None while a
    holder keeps it until dropped."""

    info: CapsuleInfo
    names: tuple[str, ...]
    holders: tuple[str, ...]
    expires_in_s: float | None
    chunks: int


class Published(NamedTuple):
    """What a publish did: the capsule (tier "fleet"), its chunks and bytes, how many of them
    this call sent (the others were on the server already), and how long it took."""

    info: CapsuleInfo
    chunks: int
    nbytes: int
    chunks_sent: int
    bytes_sent: int
    seconds: float


class Fetched(NamedTuple):
    """A fleet capsule verified in this process's memory, not yet in a store (``FleetTier.fetch``)."""

    info: CapsuleInfo
    log: tuple
    data: torch.Tensor
    received: int


class Collected(NamedTuple):
    """What a collection did: chunks deleted and their bytes; manifests read, chunks they name;
    manifests it could not read (while there are any, it deletes nothing)."""

    chunks_deleted: int
    bytes_freed: int
    manifests: int
    chunks_named: int
    unreadable: tuple[str, ...]


@dataclass(slots=True)
class FleetStats:
    """Counters for diagnostics (a copy: ``FleetTier.stats()``)."""

    published: int = 0
    pulled: int = 0
    served_locally: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    failures: int = 0
    last_latency_s: float = 0.0
    last_error: str = ""


class _Deadline:
    """The time an operation may take in all (None: bounded only by each exchange's timeout)."""

    __slots__ = ("what", "limit", "end")

    def __init__(self, what: str, seconds: float | None) -> None:
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not seconds > 0):
            raise InvalidCapsuleRequest(f"deadline_s must be a number of seconds > 0, got {seconds!r}")
        self.what, self.limit = what, seconds
        self.end = None if seconds is None else time.monotonic() + seconds

    def check(self) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise FleetUnavailable(f"fleet tier: {self.what} did not finish within its deadline of {self.limit} s")


class FleetTier:
    """Capsules on one Valkey or Redis server, under one key prefix, signed with ``key``.

    ``options``: the other fields of ``FleetConfig`` (password_file, username, timeout_s,
    connect_timeout_s, chunk_bytes, chunk_rows, grace_s, node, batch_bytes). Nothing connects
    here: the first call does, so a node can start while the server is down. Thread-safe."""

    def __init__(self, url: str, key: bytes | None, prefix: str = "flashrt", **options: Any) -> None:
        if not isinstance(key, bytes) or not signing.MIN_KEY_BYTES <= len(key) <= signing.MAX_KEY_BYTES:
            raise InvalidCapsuleRequest(
                "the fleet tier requires a capsule key (capsule_key_file) of "
                f"{signing.MIN_KEY_BYTES} to {signing.MAX_KEY_BYTES} bytes: nothing unsigned is published or loaded")
        try:
            self.config = FleetConfig(url=url, prefix=prefix, **options)
        except TypeError as exc:   # an unknown option
            raise InvalidCapsuleRequest(f"fleet tier: {exc}") from None
        self._key = key
        self.keys = FleetKeys(prefix)
        self._client = self.config.connect()
        self._scripts = Scripts(self._client)
        self._stats = FleetStats()
        self._stats_lock = threading.Lock()
        self._held: set[str] = set()   # ids this client took a reference on (publish, hold), until dropped
        # One thread hashes what pulls receive, in the order handed over: a pull's own parts stay
        # in order, and a pull starts no thread (made at the first pull, ended by ``close``).
        self._hasher: ThreadPoolExecutor | None = None

    # ---- queries ---------------------------------------------------------------------------------
    def ping(self) -> float:
        """The round trip to the server, in seconds (FleetUnavailable if there is none)."""
        with self._talking("ping"):
            start = time.monotonic()
            self._client.ping()
            latency = time.monotonic() - start
        self._count(last_latency_s=latency)
        return latency

    def stats(self) -> FleetStats:
        with self._stats_lock:
            return replace(self._stats)

    def close(self) -> None:
        """Close the connections and end the hashing thread (a later call opens new ones)."""
        self._client.close()
        with self._stats_lock:
            hasher, self._hasher = self._hasher, None
        if hasher is not None:
            hasher.shutdown(wait=True)

    def _hashing(self) -> ThreadPoolExecutor:
        with self._stats_lock:
            if self._hasher is None:
                self._hasher = ThreadPoolExecutor(1, thread_name_prefix="fleet-pull-hash")
            return self._hasher

    def resolve(self, ref: str) -> str:
        """The capsule id ``ref`` names on the server: an id as it is, a name through its
        signed entry (UnknownCapsule if no name entry, UntrustedCapsule if not signed with the key)."""
        if is_capsule_id(ref):
            return ref
        if not isinstance(ref, str) or not ref:
            raise InvalidCapsuleRequest(f"a fleet capsule is named by a non-empty id or name, got {shown(ref)}")
        name = check_name(ref)
        with self._talking("resolve a name"):
            value = self._client.get(self.keys.name(name))
        if value is None:
            raise UnknownCapsule(f"no fleet capsule is named {name!r}")
        return fleet_manifest.name_target(self._key, name, value)

    def list(self) -> list[FleetCapsule]:
        """The fleet capsules signed with this tier's key, oldest first (others are skipped
        and logged), whatever their model: ``info`` carries the fingerprints to compare."""
        with self._talking("list"):
            manifest_keys = list(self._client.scan_iter(match=self.keys.pattern("manifest"), count=_SCAN_COUNT))
            ids = [k.decode().rpartition(":")[2] for k in manifest_keys]
            pipe = self._client.pipeline(transaction=False)
            for capsule_id in ids:
                pipe.get(self.keys.manifest(capsule_id))
                pipe.zrange(self.keys.holders(capsule_id), 0, -1, withscores=True)
                pipe.pttl(self.keys.manifest(capsule_id))
            answers = pipe.execute() if ids else []
            names = self._names()
        out = []
        for i, capsule_id in enumerate(ids):
            raw, holders, ttl = answers[3 * i:3 * i + 3]
            if raw is None:   # expired or dropped between the scan and the read
                continue
            try:
                info, digests = fleet_manifest.read_signed(raw, self._key, capsule_id)
            except CapsuleError as exc:
                log.warning("fleet capsule %s skipped in the list: %s", capsule_id, exc)
                continue
            own = tuple(sorted(n for n, target in names.items() if target == capsule_id))
            out.append(FleetCapsule(info._replace(name=own[0] if own else ""), own,
                                    tuple(h.decode() for h, _ in holders), None if ttl < 0 else ttl / 1000.0,
                                    len(digests)))
        out.sort(key=lambda c: c.info.created)
        return out

    # ---- publish ---------------------------------------------------------------------------------
    def publish(self, store: CapsuleStore, ref: str | CapsuleInfo, name: str | None = None,
                ttl_s: float | None = None, *, deadline_s: float | None = None,
                progress: Callable[[int, int], None] | None = None) -> Published:
        """Publish the store's capsule ``ref`` (from whichever tier holds it) under its id,
        with this node's reference on it for ``ttl_s`` seconds (None: until dropped).

        ``name``: a name to point at it (None: the capsule's own name, if it has one; "": none).
        A name is a tag: publishing another capsule under it moves it. ``progress(sent, total)``
        is called after each batch of chunks sent. Publishing a capsule again renews this
        node's reference and sends only what the server lost."""
        lease = _lease_ms(ttl_s)
        if name:
            check_name(name)
        deadline = _Deadline("publish", deadline_s)
        started = time.monotonic()
        info, log_runs, data = store.export(ref)
        name = info.name if name is None else name
        layout = store.layout
        # The bytes are not hashed again here: every reader checks them against the capsule
        # digest the manifest carries, so a capsule damaged in this store is refused, not restored.
        if not info.digest:
            raise CorruptCapsule(f"capsule {info.id} has no digest (its hash failed); not published")
        chunking = self.chunking(layout)
        values = [chunk_bytes(data.numpy(), span) for span in wire_chunks(layout, info.position, chunking)]
        # Named with the capsule's digest where the store was asked to (``prepare``), else here.
        named = store.chunk_names(info.id, chunking)
        digests = list(named) if named is not None else [digest(v) for v in values]
        manifest = fleet_manifest.encode(info, log_runs, layout, chunking, digests, self._key)
        try:
            sent, sent_bytes = self._commit(info.id, manifest, name, lease, digests, dict(zip(digests, values)),
                                            deadline, progress)
        except CapsuleError:
            self._count(failures=1)
            raise
        self._count(published=1, bytes_sent=sent_bytes)
        with self._stats_lock:
            self._held.add(info.id)
        whole = info._replace(tier="fleet", name=name or "", pinned=False, nbytes=layout.ranges_bytes(info.position))
        return Published(whole, len(digests), whole.nbytes, sent, sent_bytes, time.monotonic() - started)

    def chunking(self, layout: Layout) -> Chunking:
        """How this tier cuts a capsule of ``layout`` (``fleet_chunks``)."""
        return chunking_for(layout, self.config.chunk_rows, self.config.chunk_bytes)

    def prepare(self, store: CapsuleStore) -> None:
        """Have ``store`` name each capsule's chunks as this tier cuts them when it hashes the
        capsule's digest, off the snapshot path, so that a publish of it hashes nothing."""
        store.name_chunks(self.chunking(store.layout))

    def check_publish(self, name: str | None, ttl_s: float | None) -> None:
        """InvalidCapsuleRequest now for a name or a lease a publish would refuse: a caller
        about to make a capsule only to publish it asks first."""
        _lease_ms(ttl_s)
        if name:
            check_name(name)

    def _commit(self, capsule_id: str, manifest: bytes, name: str, lease: str, digests: list[str],
                unique: dict[str, Any], deadline: _Deadline,
                progress: Callable[[int, int], None] | None) -> tuple[int, int]:
        """Touch the chunks, send the missing ones, commit the manifest; again while chunks
        vanish in between, ``PUBLISH_ATTEMPTS`` times. ``unique``: digest -> value, a chunk
        repeated inside the capsule once. (chunks, bytes) sent."""
        sent = sent_bytes = 0
        for attempt in range(PUBLISH_ATTEMPTS):
            with self._talking("publish"):
                touched = self._scripts.touch(keys=[self.keys.touched, *map(self.keys.chunk, unique)],
                                              args=[2 * self._grace_ms(), *unique])
                self._check(outcome(touched[:2])[0])
                missing = [d for d, here in zip(unique, touched[2:]) if not here]
                n, b = self._send(missing, unique, deadline, progress, len(unique))
                sent, sent_bytes = sent + n, sent_bytes + b
                deadline.check()
                word, index = outcome(self._scripts.commit(
                    keys=[self.keys.manifest(capsule_id), self.keys.holders(capsule_id), self.keys.names_of(capsule_id),
                          self.keys.touched, self.keys.name(name) if name else self.keys.manifest(capsule_id),
                          *map(self.keys.chunk, digests)],
                    args=[manifest, self.config.node, lease, self._grace_ms(), name or "",
                          fleet_manifest.name_value(self._key, name, capsule_id) if name else "",
                          self.keys.name_prefix, capsule_id, *digests]))
            self._check(word)
            if word == "ok":
                return sent, sent_bytes
            if word == "conflict":
                raise InvalidCapsuleRequest(
                    f"fleet capsule {capsule_id} is on the server already with another manifest (another chunking "
                    "or another capsule key: keep chunk_bytes, chunk_rows and the key equal across the fleet)")
            log.warning("fleet publish of %s: chunk %d was %s at the commit (attempt %d of %d); sending again",
                        capsule_id, index, "gone" if word == "missing" else "touched too long ago",
                        attempt + 1, PUBLISH_ATTEMPTS)
        if word == "missing":
            raise CapsuleIOError(f"fleet tier: chunks of capsule {capsule_id} vanished between touch and commit "
                                 f"{PUBLISH_ATTEMPTS} times (evicted under maxmemory, or collected by a "
                                 "collector whose grace_s is shorter than this publisher's?)")
        raise CapsuleIOError(f"fleet tier: publishing capsule {capsule_id} took longer than grace_s "
                             f"({self.config.grace_s} s) {PUBLISH_ATTEMPTS} times; raise grace_s")

    def _send(self, missing: Sequence[str], values: dict[str, bytes | memoryview], deadline: _Deadline,
              progress: Callable[[int, int], None] | None, total: int) -> tuple[int, int]:
        """SET NX the chunks ``missing``, pipelined in batches of about ``batch_bytes``:
        (chunks, bytes) this call wrote (a concurrent publisher may have written some first)."""
        written = written_bytes = done = 0
        ttl = 2 * self._grace_ms()   # a chunk no manifest comes to name expires on its own
        for batch in _batches(missing, lambda d: len(values[d]), self.config.batch_bytes):
            deadline.check()
            pipe = self._client.pipeline(transaction=False)
            for d in batch:
                pipe.set(self.keys.chunk(d), values[d], nx=True, px=ttl)
            for d, created in zip(batch, pipe.execute()):
                if created:
                    written += 1
                    written_bytes += len(values[d])
            done += len(batch)
            if progress is not None:
                progress(total - len(missing) + done, total)
        return written, written_bytes

    # ---- pull ------------------------------------------------------------------------------------
    def pull(self, store: CapsuleStore, ref: str, tier: str = "host", *, name: str | None = None,
             deadline_s: float | None = None) -> CapsuleInfo:
        """The fleet capsule ``ref`` (an id or a name) as a capsule of ``store`` in ``tier``, its
        id the same, named ``name`` there (None: ``ref`` when it is a name): ``local``, else
        ``fetch`` then ``adopt``. Refused whole, with nothing added: UnknownCapsule,
        UntrustedCapsule, FingerprintMismatch, CorruptCapsule, IncompleteCapsule (a chunk is
        gone), BudgetExceeded (no room here), FleetUnavailable."""
        capsule_id = self.resolve(ref)
        held = self.local(store, capsule_id)
        if held is not None:
            return held
        fetched = self.fetch(store, capsule_id, tier, deadline_s=deadline_s)
        return self.adopt(store, fetched, tier, ref if name is None and ref != capsule_id else name or "")

    def local(self, store: CapsuleStore, capsule_id: str) -> CapsuleInfo | None:
        """The store's own copy of fleet capsule ``capsule_id`` (an id: a name may move, resolve it
        first), if it holds one; None if it must be fetched."""
        if store.kept(capsule_id) is None:
            return None
        self._count(served_locally=1)
        return store.get(capsule_id)

    def fetch(self, store: CapsuleStore, capsule_id: str, tier: str = "host", *,
              deadline_s: float | None = None) -> Fetched:
        """Fleet capsule ``capsule_id``'s manifest checked against ``store``'s model and layout,
        its chunks fetched into memory this process allocates and verified whole (its digest
        and history hash): what ``adopt`` adds. The store is only asked
        whether ``tier`` has room; nothing is added to it."""
        check_tier(tier)
        deadline = _Deadline("pull", deadline_s)
        try:
            with self._talking("pull"):
                raw = self._client.get(self.keys.manifest(capsule_id))
            if raw is None:
                raise UnknownCapsule(f"no fleet capsule {capsule_id}")
            manifest = fleet_manifest.decode(raw, self._key, store.layout, store.log_kinds, store.model_fingerprint,
                                             capsule_id)
            info = manifest.info
            store.check_room(tier, info.nbytes)
            # This process's memory, not the client's buffers (4 KiB pages: a huge page's first
            # fault may stall on compaction, and this is a request's path; see hugepages).
            data = torch.empty(info.nbytes, dtype=torch.uint8)
            received, arrived = self._fetch(manifest, data.numpy(), deadline)
            read = range_reader(store.layout.ranges(info.position), data)
            # One hash of the whole checks every chunk: the signed manifest carries the digest.
            # Only a capsule refused is hashed chunk by chunk, to name what is wrong.
            if arrived != info.digest:
                raise CorruptCapsule(f"fleet capsule {capsule_id}: {self._altered(manifest, data.numpy())}")
            if history_digest(store.layout.regions, info.position, read) != info.history_hash:
                raise CorruptCapsule(f"fleet capsule {capsule_id}: does not match its history hash")
        except CapsuleError:
            self._count(failures=1)
            raise
        return Fetched(info, manifest.log, data, received)

    def adopt(self, store: CapsuleStore, fetched: Fetched, tier: str, name: str = "") -> CapsuleInfo:
        """The fetched capsule added to ``store``'s ``tier`` under ``name`` (``CapsuleStore.adopt``:
        the store takes ``fetched.data`` over)."""
        try:
            pulled = store.adopt(fetched.info._replace(name=name), fetched.log, fetched.data, tier)
        except CapsuleError:
            self._count(failures=1)
            raise
        self._count(pulled=1, bytes_received=fetched.received)
        return pulled

    def _fetch(self, manifest: fleet_manifest.Manifest, out: Any, deadline: _Deadline) -> tuple[int, str]:
        """Every chunk of the manifest read into its place in ``out``, checked against its length, and the
        capsule digest of what arrived: (bytes received, digest). The bytes are hashed in
        order on a thread of their own while the next batch is on its way. Chunks are fetched
        once each, in the order of their first use, so a batch completes the data up to its
        last chunk's first use (a repeat further on is placed, but what lies before it may
        not be yet); the rest is hashed once every batch is in."""
        where: dict[str, list[Span]] = {}
        for d, span in zip(manifest.digests, manifest.spans):
            where.setdefault(d, []).append(span)
        first = {d: i for i, d in reversed(list(enumerate(manifest.digests)))}
        received = hashed = 0
        capsule_id = manifest.info.id
        whole = state_hasher(every_core=True)   # a pull waits for it
        hasher = self._hashing()
        pending: list[Future] = []

        def later(fn: Callable[..., Any], *args: Any) -> None:
            try:
                pending.append(hasher.submit(fn, *args))
            except RuntimeError:   # shut down: ``close`` ran meanwhile
                error = FleetUnavailable(f"fleet tier: closed while pulling capsule {capsule_id}")
                self._count(last_error=str(error))
                raise error from None

        try:
            # ``out`` is fresh memory: its pages are mapped while the first batch is on its way.
            later(populate, torch.from_numpy(out))
            for batch in _batches(list(where), lambda d: length(where[d][0]),
                                  self.pull_batch_bytes(manifest.info.nbytes)):
                deadline.check()
                places = [memoryview(out[slice(*where[d][0])]) for d in batch]
                with self._talking("pull"):
                    unfit = get_into(self._client, [self.keys.chunk(d) for d in batch], places)
                if unfit is not None:
                    d = batch[unfit.index]
                    index = first[d]
                    if unfit.length is None:
                        raise IncompleteCapsule(f"fleet capsule {capsule_id}: chunk {index} ({d[:16]}) is gone from "
                                                "the server (evicted or collected); publish the capsule again")
                    raise CorruptCapsule(f"fleet capsule {capsule_id}: chunk {index} ({d[:16]}) does not match "
                                         f"its digest ({unfit.length} bytes, {len(places[unfit.index])} expected)"
                                         + self._removal(self._remove_altered(d)))
                for d, place in zip(batch, places):
                    for span in where[d][1:]:   # a chunk the capsule holds more than once
                        out[slice(*span)] = place
                    received += len(place)
                done = manifest.spans[first[batch[-1]]][1]
                later(whole.update, memoryview(out[hashed:done]))
                hashed = done
            later(whole.update, memoryview(out[hashed:]))
            for part in pending:
                part.result()
        except BaseException:
            for part in pending:   # refused: what is queued is not run; what runs ends before ``out`` is let go
                part.cancel()
            wait(pending)
            raise
        return received, whole.hexdigest()

    def pull_batch_bytes(self, nbytes: int) -> int:
        """The bytes of one batch of a pull of an ``nbytes`` capsule: at most ``batch_bytes``,
        and few enough that hashing what one batch brought overlaps the next (``PULL_BATCHES``
        batches or more), down to a chunk's size."""
        return max(self.config.chunk_bytes, min(self.config.batch_bytes, -(-nbytes // PULL_BATCHES)))

    def _altered(self, manifest: fleet_manifest.Manifest, data: Any) -> str:
        """Why a capsule whose chunks are in place as ``data`` fails its digest: the first chunk
        that does not match its name, or none (then the publisher's own bytes were damaged).
        Every chunk that does not match its name is removed from the server: no manifest can
        need bytes other than those its name hashes, and while they stay, every capsule that
        shares the chunk is refused and its publishers find the chunk there and do not send it."""
        altered = [(index, d) for index, (d, span) in enumerate(zip(manifest.digests, manifest.spans))
                   if digest(chunk_bytes(data, span)) != d]
        if not altered:
            return "its chunks verify, but the capsule they make does not match its digest"
        removed = [self._remove_altered(d) for d in dict.fromkeys(d for _, d in altered)]
        index, d = altered[0]
        return f"chunk {index} ({d[:16]}) does not match its digest" + self._removal(all(removed))

    @staticmethod
    def _removal(removed: bool) -> str:
        return ("; removed from the server, so that the next publish of a capsule that holds it sends it again"
                if removed else "; it could not be removed from the server (see the log)")

    def _remove_altered(self, d: str) -> bool:
        """Delete chunk ``d`` if the server still holds bytes that do not hash to its name (a
        publisher may have set good ones meanwhile: WATCH makes the delete fail then). True if
        it is gone or good now; False if the server refused (an ACL that allows no delete)."""
        key = self.keys.chunk(d)
        try:
            with self._client.pipeline(transaction=True) as pipe:
                pipe.watch(key)
                value = pipe.get(key)
                if value is not None and digest(value) != d:
                    pipe.multi()
                    pipe.delete(key)
                    pipe.execute()
            return True
        except redis.exceptions.WatchError:   # written meanwhile: the next reader checks it again
            return True
        except redis.exceptions.RedisError as exc:
            log.warning("fleet chunk %s does not match its name and could not be removed: %s", d[:16], exc)
            return False

    # ---- references ------------------------------------------------------------------------------
    def hold(self, ref: str, ttl_s: float | None = None) -> None:
        """Take or renew this node's reference on a fleet capsule for ``ttl_s`` seconds (None:
        until dropped); its chunks are kept at least as long. IncompleteCapsule if a chunk is gone."""
        lease = _lease_ms(ttl_s)
        capsule_id = self.resolve(ref)
        with self._talking("hold"):
            raw = self._client.get(self.keys.manifest(capsule_id))
        if raw is None:
            raise UnknownCapsule(f"no fleet capsule {capsule_id}")
        _, digests = fleet_manifest.read_signed(raw, self._key, capsule_id)
        with self._talking("hold"):
            word, index = outcome(self._scripts.hold(
                keys=[self.keys.manifest(capsule_id), self.keys.holders(capsule_id), self.keys.names_of(capsule_id),
                      *map(self.keys.chunk, digests)],
                args=[self.config.node, lease, self._grace_ms(), self.keys.name_prefix, capsule_id]))
        self._check(word)
        if word == "unknown":
            raise UnknownCapsule(f"no fleet capsule {capsule_id}")
        if word == "missing":
            raise IncompleteCapsule(f"fleet capsule {capsule_id}: chunk {index - 1} is gone from the server")
        with self._stats_lock:
            self._held.add(capsule_id)

    def drop(self, ref: str) -> bool:
        """Remove this node's reference on a fleet capsule. True: it was the last one, and
        the capsule's manifest and names are gone (its chunks go at the next ``collect``, or
        when they expire); False: other nodes still hold it. UnknownCapsule if this node
        holds no reference on it."""
        capsule_id = self.resolve(ref)
        with self._talking("drop"):
            word, others = outcome(self._scripts.drop(
                keys=[self.keys.manifest(capsule_id), self.keys.holders(capsule_id), self.keys.names_of(capsule_id)],
                args=[self.config.node, self.keys.name_prefix, capsule_id]))
        self._check(word)
        if word == "unknown":
            raise UnknownCapsule(f"no fleet capsule {capsule_id}")
        with self._stats_lock:
            self._held.discard(capsule_id)
        if word == "not_held":
            raise UnknownCapsule(f"fleet capsule {capsule_id} holds no reference of node {self.config.node!r}")
        return word == "gone"

    def took_reference(self, capsule_id: str) -> bool:
        """Whether this client took a reference on ``capsule_id`` (a publish or a hold) and has
        not dropped it: a local answer, with no call to the server. A reference of this node
        taken by another client (an earlier run) is not known here."""
        with self._stats_lock:
            return capsule_id in self._held

    # ---- collection ------------------------------------------------------------------------------
    def collect(self) -> Collected:
        """Delete the chunks that no manifest names and that no publisher touched within the
        grace period. Safe while other nodes publish (``fleet_scripts``, invariants 1-2): the
        cutoff is taken from the server's clock before the manifests are read, and each
        chunk's touch time is checked again in the step that deletes it."""
        with self._talking("collect"):
            sec, usec = self._client.time()
            cutoff = sec * 1000 + usec // 1000 - self._grace_ms()
            named: set[str] = set()
            unreadable: list[str] = []
            manifests = 0
            keys = list(self._client.scan_iter(match=self.keys.pattern("manifest"), count=_SCAN_COUNT))
            for batch in _batches(keys, lambda _: 1, _SCAN_COUNT):
                for key, raw in zip(batch, self._client.mget(batch)):
                    if raw is None:
                        continue
                    manifests += 1
                    found = fleet_manifest.chunk_digests(raw)
                    if found is None:
                        unreadable.append(key.decode())
                    else:
                        named.update(found)
            if unreadable:
                # A manifest of another version may name chunks in a way this one cannot read.
                log.warning("fleet collect deletes nothing: %d manifests cannot be read (%s)", len(unreadable),
                            ", ".join(unreadable[:3]))
                return Collected(0, 0, manifests, len(named), tuple(unreadable))
            candidates = [m.decode() for m, score in self._client.zscan_iter(self.keys.touched, count=_SCAN_COUNT)
                          if score < cutoff and m.decode() not in named]
            deleted = freed = 0
            for batch in _batches(candidates, lambda _: 1, _COLLECT_BATCH):
                n, b = self._scripts.collect(keys=[self.keys.touched, *map(self.keys.chunk, batch)],
                                             args=[cutoff, *batch])
                deleted, freed = deleted + int(n), freed + int(b)
        return Collected(deleted, freed, manifests, len(named), ())

    # ---- helpers ---------------------------------------------------------------------------------
    def _names(self) -> dict[str, str]:
        """Every name under the prefix whose entry is signed with the key -> the id it points at."""
        keys = list(self._client.scan_iter(match=self.keys.pattern("name"), count=_SCAN_COUNT))
        names: dict[str, str] = {}
        for batch in _batches(keys, lambda _: 1, _SCAN_COUNT):
            for key, value in zip(batch, self._client.mget(batch)):
                name = key.decode()[len(self.keys.name_prefix):]
                if value is None:
                    continue
                try:
                    names[name] = fleet_manifest.name_target(self._key, name, value)
                except CapsuleError as exc:
                    log.warning("fleet name %r skipped: %s", name, exc)
        return names

    def _check(self, word: str) -> None:
        """A script's refusal to write over a key of another type (nothing was written)."""
        if word == "wrongtype":
            self._count(failures=1)
            raise CapsuleIOError(f"fleet tier: a key under prefix {self.config.prefix!r} holds another type than "
                                 "this tier writes there: is another application using the prefix?")

    def _grace_ms(self) -> int:
        return int(self.config.grace_s * 1000)

    def _count(self, **changes: Any) -> None:
        with self._stats_lock:
            for name, value in changes.items():
                if name in ("last_latency_s", "last_error"):
                    setattr(self._stats, name, value)
                else:
                    setattr(self._stats, name, getattr(self._stats, name) + value)

    @contextmanager
    def _talking(self, what: str) -> Iterator[None]:
        """Server and client failures as this package's errors, each with its code."""
        try:
            yield
        except redis.exceptions.RedisError as exc:
            error = self._error(what, exc)
            self._count(last_error=str(error))
            raise error from None

    def _error(self, what: str, exc: redis.exceptions.RedisError) -> CapsuleError:
        where = f"fleet tier ({self.config.url}, prefix {self.config.prefix!r}): {what}"
        text = str(exc)[:300]
        if isinstance(exc, redis.exceptions.TimeoutError):
            return FleetUnavailable(f"{where}: the server did not answer within {self.config.timeout_s} s ({text})")
        if isinstance(exc, redis.exceptions.AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
            return FleetUnavailable(f"{where}: the server refused this client's credentials ({text})")
        if isinstance(exc, redis.exceptions.ConnectionError):
            return FleetUnavailable(f"{where}: cannot reach the server ({text})")
        if isinstance(exc, redis.exceptions.NoPermissionError) or "NOPERM" in text:
            return FleetUnavailable(f"{where}: the server's ACL refuses this user a command or key ({text})")
        if isinstance(exc, redis.exceptions.OutOfMemoryError) or "maxmemory" in text:
            return BudgetExceeded(f"{where}: the server is out of memory (maxmemory) and refused the write ({text})")
        return CapsuleIOError(f"{where}: the server answered an error ({text})")


def _lease_ms(ttl_s: float | None) -> str:
    """A lease as the scripts take it: ms, or 'inf' (until dropped)."""
    if ttl_s is None:
        return "inf"
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0.001 <= ttl_s <= 1e9:
        raise InvalidCapsuleRequest(f"ttl_s must be None (until dropped) or seconds in [0.001, 1e9], got {ttl_s!r}")
    return str(int(ttl_s * 1000))


def _batches(items: Sequence, size: Callable[[Any], int], most: int) -> Iterator[list]:
    """``items`` in order, in batches whose sizes add up to at most ``most`` (one item at the least)."""
    batch: list = []
    total = 0
    for item in items:
        n = size(item)
        if batch and total + n > most:
            yield batch
            batch, total = [], 0
        batch.append(item)
        total += n
    if batch:
        yield batch
