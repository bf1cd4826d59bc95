"""Capsule costs, each as a ratio measured side by side in one run.

    python -m flashrt_ros.bench.capsules [--device cpu] [--rounds 5] [--ttft 2048,4096,8192,16384]

1. snapshot and restore time / one plain tensor copy of the same number of
   bytes on the same device, each from a flushed cache, across state sizes
   (target <= 1.3 from 4 MiB); without a target: the digest a snapshot leaves
   to the background thread (it computes it in the caller's thread here), the
   snapshot's copy made through torch with no bookkeeping (views of the state's
   ranges and one batched copy), and a return (a restore of the capsule
   the live state descends from, after 8 decode steps built on it: it copies the
   fixed-size state only, as those 8 rows lie past the capsule's position), each
   over the same plain copy of the whole state;
2. TTFT through a capsule (restore a P-token prefix, prefill a 64-token
   suffix, first token = the argmax of its last logits) vs a cold prefill of
   the P + 64 tokens, on ``ModelConfig.bench()`` (targets: the paper's 3.9x at
   2k and 27x at 16k; via capsule at 16k within 1.25x of the TTFT of 64 tokens
   on an empty state);
3. the disk tier: a disk snapshot / a plain write + fsync of the same bytes (target <= 1.5),
   a restore from disk (read and verified) / a plain read of the file plus one digest pass
   (target <= 2), and what a capsule stores, region by region;
4. rollback bookkeeping (timed inside decode steps) / decode time (target <= 5%).
"""
from __future__ import annotations

from dataclasses import replace

import os
import shutil
import statistics
import tempfile
import time

import torch

from ..runtime import Engine, ModelConfig
from .common import (CacheFlush, add_ttft_prefixes, bench_main, copy_pair, interleaved, machine, matmul_rate,
                     positive_int, sync, timed, verdict)

SUFFIX = 64


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32768, (n,), generator=torch.Generator().manual_seed(seed))


RETURN_TOKENS = 8


def _forget_base(engine: Engine) -> None:
    """The live state as if it descended from no capsule: the next copy is a full one."""
    engine._live.state = replace(engine._live.state, base=None)


def copy_ratios(engine: Engine, positions: list[int], rounds: int) -> list[dict]:
    """Every contender starts from a flushed cache: a restore and the copy just before it
    share the arena and capsule bytes, which fit the last-level cache up to ~13 MiB here,
    while the baseline's buffers would be cold (a restore measured 0.95x a copy that way)."""
    dev, rows = engine.device, []
    flush = CacheFlush(dev)
    for position in positions:
        engine.reset()
        engine.prefill(_ids(position, position))
        nbytes = sum(e - s for s, e in engine.capsules.layout.ranges(position))
        src, dst = copy_pair(nbytes, dev)
        held = engine.snapshot()
        engine.capsules.get(held.id)   # its digest now: left queued, it would run during a timing
        digests: list[float] = []

        def snap() -> float:
            _forget_base(engine)  # a full snapshot: nothing shared with an earlier capsule
            flush()
            t = timed(lambda: engine.snapshot(), dev)
            taken = engine.capsules.list()[-1].id
            # The digest, off the snapshot's clock: get() computes it in this thread (it is queued,
            # not started), so it is timed alone; in use it runs on the digest thread.
            digests.append(timed(lambda: engine.capsules.get(taken), dev))
            engine.capsules.drop(taken)
            return t

        def restore() -> float:
            _forget_base(engine)  # a full restore: the live state shares no rows with the capsule
            flush()
            return timed(lambda: engine.restore(held), dev)

        def back() -> float:
            engine.restore(held)
            engine.generate(RETURN_TOKENS)   # work built on the capsule: rows it does not hold
            flush()
            return timed(lambda: engine.restore(held), dev)

        def copy() -> float:
            flush()
            return timed(lambda: dst.copy_(src), dev)

        ranges = engine.capsules.layout.ranges(position)

        def views() -> float:
            flush()
            return timed(lambda: _views_and_copy(engine.arena.buffer, ranges, dst), dev)

        # Sub-millisecond timings on a shared machine: many more rounds than the TTFT section.
        t = interleaved({"snapshot": snap, "restore": restore, "back": back, "copy": copy, "views": views},
                        rounds * 8)
        engine.capsules.drop(held)
        rows.append({"position": position, "bytes": nbytes, "copy_ms": t["copy"] * 1e3,
                     "snapshot_ratio": t["snapshot"] / t["copy"], "restore_ratio": t["restore"] / t["copy"],
                     "digest_ratio": statistics.median(digests) / t["copy"],
                     "return_ratio": t["back"] / t["copy"], "views_ratio": t["views"] / t["copy"]})
        print(f"  {nbytes / 2**20:8.2f} MiB (pos {position:5d}): copy {t['copy'] * 1e3:7.3f} ms   "
              f"snapshot x{rows[-1]['snapshot_ratio']:.2f} (digest after it x{rows[-1]['digest_ratio']:.1f})   "
              f"restore x{rows[-1]['restore_ratio']:.2f}   return x{rows[-1]['return_ratio']:.2f}   "
              f"torch views x{rows[-1]['views_ratio']:.2f}")
    if rows:
        print("  digest: BLAKE3 of the capsule, which a snapshot leaves to the digest thread (the other "
              "core's time, not the caller's)")
        print(f"  torch views: the views of the state's {len(ranges)} ranges and one batched torch copy of them, "
              f"with no bookkeeping: a snapshot's copy as torch alone would make it")
    return rows


def disk_ratios(engine: Engine, positions: list[int], rounds: int) -> list[dict]:
    """A disk snapshot against a plain write + fsync of the same bytes into the same folder, and a
    restore from disk (which reads and verifies the file every time) against a plain read of the
    file plus one pass of the digest over it. Both sides find the file in the page cache."""
    from blake3 import blake3

    dev, rows, folder = engine.device, [], engine.capsules.dir
    for position in positions:
        engine.reset()
        engine.prefill(_ids(position, position))
        held = engine.snapshot(tier="disk")
        path = folder / f"{held.id}.capsule"
        size = path.stat().st_size
        payload = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
        plain = folder / "plain.bin"

        def snap() -> float:
            t = timed(lambda: engine.snapshot(tier="disk"), dev)
            engine.capsules.drop(engine.capsules.list()[-1].id)
            return t

        def write() -> float:
            def run() -> None:
                with open(plain, "wb") as f:
                    f.write(payload.numpy().data)
                    f.flush()
                    os.fsync(f.fileno())
            t = timed(run, dev)
            plain.unlink()
            return t

        def restore() -> float:
            _forget_base(engine)
            return timed(lambda: engine.restore(held), dev)

        def read_and_hash() -> float:
            return timed(lambda: blake3(path.read_bytes()).hexdigest(), dev)

        t = interleaved({"snapshot": snap, "write": write, "restore": restore, "read": read_and_hash}, rounds * 2)
        engine.capsules.drop(held)
        rows.append({"position": position, "file_bytes": size, "snapshot_ratio": t["snapshot"] / t["write"],
                     "restore_ratio": t["restore"] / t["read"], "write_ms": t["write"] * 1e3,
                     "read_ms": t["read"] * 1e3})
        print(f"  {size / 2**20:8.2f} MiB (pos {position:5d}): write+fsync {t['write'] * 1e3:7.2f} ms, disk snapshot "
              f"x{rows[-1]['snapshot_ratio']:.2f}   read+digest {t['read'] * 1e3:6.2f} ms, disk restore "
              f"x{rows[-1]['restore_ratio']:.2f}")
    return rows


def size_account(engine: Engine) -> dict:
    """What a capsule stores, region by region: the fixed-size block and the bytes per token."""
    regions = engine.capsules.layout.regions
    per_token = {r.name: r.row_bytes for r in regions if r.per_token}
    fixed = {r.name: r.nbytes for r in regions if not r.per_token}
    padding = engine.arena.fixed_bytes - sum(fixed.values())
    print(f"  fixed-size block {engine.arena.fixed_bytes} bytes: " + ", ".join(f"{k} {v}" for k, v in fixed.items())
          + f", alignment padding {padding}")
    print(f"  per token {sum(per_token.values())} bytes: " + ", ".join(f"{k} {v}" for k, v in per_token.items()))
    return {"fixed": fixed, "padding": padding, "per_token": per_token}


def _views_and_copy(buffer: torch.Tensor, ranges: list[tuple[int, int]], out: torch.Tensor) -> None:
    targets, sources, at = [], [], 0
    for start, end in ranges:
        targets.append(out[at:at + end - start])
        sources.append(buffer[start:end])
        at += end - start
    torch._foreach_copy_(targets, sources)


def ttft(engine: Engine, prefixes: list[int], rounds: int) -> list[dict]:
    """Time to the first token: the argmax of the prefill's last logits (committing that
    token with a decode step comes after it is known). The empty-prefix TTFT is measured
    in each prefix's rounds, so that drift hits the ratio's two sides alike."""
    dev, rows = engine.device, []
    suffix = _ids(SUFFIX, 1)
    rounds = max(3, rounds // 2 | 1)   # odd, for a true median; cold prefills at 16k take ~20 s each

    def first_token(ids: torch.Tensor) -> int:
        return int(engine.prefill(ids).argmax())

    def empty() -> float:
        engine.reset()  # off the clock: zeroing the arena is no part of a TTFT
        return timed(lambda: first_token(suffix), dev)

    rate = 0.0
    for prefix in prefixes:
        engine.reset()
        prompt = _ids(prefix, prefix)
        engine.prefill(prompt)
        capsule = engine.snapshot(pin=True)
        engine.capsules.get(capsule.id)   # its digest now, not on the other core during the timings

        def cold() -> float:
            engine.reset()
            return timed(lambda: first_token(torch.cat([prompt, suffix])), dev)

        def warm() -> float:
            engine.reset()  # a fresh state: the restore copies the whole prefix (a return would not)
            return timed(lambda: (engine.restore(capsule), first_token(suffix)), dev)

        warm(), empty()   # untimed: the first restore of a capsule and the first short prefill run slower
        t = interleaved({"cold": cold, "capsule": warm, "empty": empty}, rounds)
        engine.capsules.drop(capsule)
        rate = max(rate, matmul_rate(dev))   # the best seen: the floor is a bound, noise only lowers it
        floor = (t["empty"] + _suffix_attention_flops(engine, prefix) / rate) / t["empty"]
        rows.append({"prefix": prefix, "cold_ms": t["cold"] * 1e3, "capsule_ms": t["capsule"] * 1e3,
                     "empty_ms": t["empty"] * 1e3, "speedup": t["cold"] / t["capsule"],
                     "vs_empty": t["capsule"] / t["empty"], "vs_empty_floor": floor})
        print(f"  P={prefix:6d}: cold {t['cold'] * 1e3:9.1f} ms   capsule {t['capsule'] * 1e3:7.1f} ms   "
              f"x{rows[-1]['speedup']:.1f} faster   {rows[-1]['vs_empty']:.2f}x the empty-prefix TTFT "
              f"({t['empty'] * 1e3:.1f} ms; floor here {floor:.2f}x)")
    print(f"  floor: the empty-prefix TTFT plus the suffix's attention over the prefix and its own rows at "
          f"{rate / 1e9:.0f} GFLOP/s (the fastest square matrix product here), everything else free")
    return rows


def _suffix_attention_flops(engine: Engine, prefix: int) -> float:
    """Scores and weighted values of SUFFIX queries over prefix + SUFFIX rows, every full-attention layer."""
    cfg = engine.config
    return 4.0 * SUFFIX * (prefix + SUFFIX) * cfg.num_attention_heads * cfg.head_dim * len(cfg.full_layers)


ROLLBACK_PROMPT, ROLLBACK_TOKENS = 512, 32


def rollback_share(engine: Engine, rounds: int) -> float:
    """The boundary bookkeeping (log run, ring slot) timed where it runs, inside real decode
    steps (a tight loop of it alone, with everything cached, took a third of this). On a GPU
    each boundary is timed between synchronisations, so that its device copy is inside its
    time: an upper bound there, since the step then cannot run ahead of it."""
    dev, n = engine.device, ROLLBACK_TOKENS
    prompt = _ids(ROLLBACK_PROMPT, 3)
    live = engine._live
    boundary, spent = live.commit, [0.0]

    def counted(*args) -> None:
        sync(dev)
        start = time.perf_counter()
        boundary(*args)
        sync(dev)
        spent[0] += time.perf_counter() - start

    def share() -> float:
        engine.reset()
        engine.prefill(prompt)
        spent[0] = 0.0
        live.commit = counted
        try:
            step = timed(lambda: engine.generate(n), dev)
        finally:
            del live.commit   # the class's own method again
        return spent[0] / step

    result = interleaved({"share": share}, rounds)["share"]
    print(f"  rollback bookkeeping = {result * 100:.2f}% of decode time, timed inside {n}-token decodes "
          f"({engine.arena.fixed_bytes / 2**10:.0f} KiB fixed-size state)")
    return result


def run(device: str = "cpu", rounds: int = 5, prefixes: tuple[int, ...] = (2048, 4096, 8192, 16384)) -> dict:
    dev = torch.device(device)
    room = max(max(prefixes) + SUFFIX + 64, ROLLBACK_PROMPT + ROLLBACK_TOKENS + 8)
    folder = tempfile.mkdtemp(prefix="flashrt-bench-capsules-")
    engine = Engine.from_config(ModelConfig.bench(), device=dev, max_seq_len=room, capsule_dir=folder,
                                budgets={"device": 2 << 30, "disk": 8 << 30})
    print(f"capsule benchmark on {machine()}; ModelConfig.bench(), fp32")
    print("1. snapshot / restore vs one plain copy of the same bytes; a return and torch views (no targets) "
          "vs the same copy")
    copies = copy_ratios(engine, [p for p in (16, 256, 1024, 4096, 16384) if p <= max(prefixes)], rounds)
    print("2. time to first token: capsule vs cold prefill")
    firsts = ttft(engine, list(prefixes), rounds)
    print("3. the disk tier: snapshot vs write + fsync, restore vs read + one digest pass")
    disk = disk_ratios(engine, [p for p in (512, 2048, 8192) if p <= max(prefixes)], rounds)
    print("   what a capsule stores")
    sizes = size_account(engine)
    print("4. rollback bookkeeping")
    share = rollback_share(engine, rounds)
    checks = []
    for row in copies:   # the target holds from 4 MiB; smaller states are reported, not held to it
        if row["bytes"] >= 4 * 2**20:
            checks.append(verdict(f"snapshot / copy at {row['bytes'] / 2**20:.1f} MiB", row["snapshot_ratio"], 1.3, False))
            checks.append(verdict(f"restore / copy at {row['bytes'] / 2**20:.1f} MiB", row["restore_ratio"], 1.3, False))
    paper = {2048: 3.9, 16384: 27.0}
    for row in firsts:
        if row["prefix"] in paper:
            checks.append(verdict(f"TTFT speed-up at {row['prefix']}", row["speedup"], paper[row["prefix"]], True))
    if firsts and firsts[-1]["prefix"] == 16384:
        checks.append(verdict("TTFT via capsule at 16k / TTFT with an empty prefix", firsts[-1]["vs_empty"], 1.25, False))
        if firsts[-1]["vs_empty_floor"] > 1.25:
            print(f"        (this device's floor for it is {firsts[-1]['vs_empty_floor']:.2f}: above the target)")
    checks.append(verdict("rollback bookkeeping / decode step", share, 0.05, False))
    for row in disk:
        checks.append(verdict(f"disk snapshot / write + fsync at {row['file_bytes'] / 2**20:.1f} MiB",
                              row["snapshot_ratio"], 1.5, False))
        checks.append(verdict(f"disk restore / read + digest at {row['file_bytes'] / 2**20:.1f} MiB",
                              row["restore_ratio"], 2.0, False))
    sync(dev)
    engine.close()
    shutil.rmtree(folder, ignore_errors=True)
    return {"machine": machine(), "device": str(dev), "time": time.time(), "copies": copies, "ttft": firsts,
            "rollback_share": share, "disk": disk, "sizes": sizes, "checks": checks}


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--rounds", type=positive_int, default=5)
        add_ttft_prefixes(parser)

    bench_main(__doc__, options, lambda a: run(a.device, a.rounds, a.ttft))


if __name__ == "__main__":
    main()
