"""Shared measuring tools: interleaved timing, medians, memcpy bandwidth, a cache flush, a
PASS/MISS line, and the command line every benchmark module has."""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

from ..hugepages import empty_huge


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{cpu}, {torch.get_num_threads()} torch threads{gpu}, torch {torch.__version__}"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved(fns: dict[str, Callable[[], float]], rounds: int, seed: int = 0) -> dict[str, float]:
    """Median of each timing function over ``rounds`` rounds. Each round calls every function
    once, in an order shuffled afresh (seeded, so runs are comparable): drift on a shared
    machine hits every contender alike, and on average each runs after each of the others
    equally often. (A rotation does not: it keeps every function's neighbours, and what ran
    just before, a digest on the other core or a cache a big copy emptied, moves a
    sub-millisecond timing.)"""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order, shuffle = list(fns), random.Random(seed).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name in order:
            samples[name].append(fns[name]())
    return {name: statistics.median(vals) for name, vals in samples.items()}


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def copy_pair(nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Source and destination for a baseline copy of ``nbytes``, every page written first:
    an untouched CPU buffer reads as the kernel's one shared zero page, which stays in cache
    and made copies from it up to 1.5x too fast. On huge pages, as the arena and the capsule
    pools are: the best bandwidth the machine gives, so a limit drawn from it (decode's, whose
    weights are on small pages) is the strict one."""
    src = empty_huge((nbytes,), torch.uint8, device).fill_(1)
    return src, empty_huge((nbytes,), torch.uint8, device).fill_(2)


def copy_bandwidth(nbytes: int, device: torch.device, rounds: int = 7) -> float:
    """Bytes moved per second by one plain copy of ``nbytes``: each byte copied is read once
    and written once, 2 x nbytes per copy (the convention of STREAM's Copy and of CUDA's
    bandwidthTest). A decode step only reads its weights: counted as bytes copied, the rate
    would be half the memory's and the limit built from it twice as lenient."""
    src, dst = copy_pair(nbytes, device)
    dst.copy_(src)
    return 2 * nbytes / statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(rounds))


class CacheFlush:
    """Writes a buffer larger than the last-level cache (32 MiB on the development CPU, 50 MB
    of L2 on an H200), so that the timed call after it finds none of its operands cached,
    whichever contender ran before: the same start for every one of them."""

    def __init__(self, device: torch.device) -> None:
        self._scratch = empty_huge(((256 if device.type == "cuda" else 64) << 20,), torch.uint8, device)
        self._value = 0

    def __call__(self) -> None:
        self._value = (self._value + 1) % 251
        self._scratch.fill_(self._value)
        sync(self._scratch.device)


def matmul_rate(device: torch.device, sizes: tuple[int, ...] = (1024, 2048), rounds: int = 5) -> float:
    """FLOP/s of the fastest square fp32 matrix product of ``sizes``, ``rounds`` each: about
    the most this device does with any kernel, for bounds (the fastest, since noise only slows)."""
    best = 0.0
    for size in sizes:
        a = torch.randn(size, size, device=device)
        b, out = torch.randn_like(a), torch.empty_like(a)
        torch.mm(a, b, out=out)
        best = max(best, 2 * size ** 3 / min(timed(lambda: torch.mm(a, b, out=out), device) for _ in range(rounds)))
    return best


def verdict(name: str, value: float, target: float, higher_is_better: bool) -> dict:
    ok = value >= target if higher_is_better else value <= target
    check = {"name": name, "value": value, "target": target, "sign": ">=" if higher_is_better else "<=", "pass": ok}
    print(verdict_line(check))
    return check


def verdict_line(check: dict) -> str:
    return (f"  {'PASS' if check['pass'] else 'MISS'}  {check['name']}: {check['value']:.3g} "
            f"(target {check['sign']} {check['target']})")


def code_version() -> str:
    """The commit the measured code came from, ``+dirty`` with uncommitted changes; "unknown"
    outside a git checkout (a symlinked colcon install resolves into the checkout)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def positive_int(text: str) -> int:
    """An argparse type: rounds, tokens and prompt lengths of 0 leave nothing to take a median of."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def bench_main(doc: str, add_arguments: Callable[[argparse.ArgumentParser], None],
               run: Callable[[argparse.Namespace], dict], device: bool = True) -> None:
    """``python -m flashrt_ros.bench.<module>``: the module's options, ``--device`` (unless
    ``device`` is False) and ``--json`` (also write the results there)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if device:
        parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add_arguments(parser)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    results = run(args) | {"code": code_version()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def add_ttft_prefixes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ttft", default="2048,4096,8192,16384", help="prefix lengths, comma-separated",
                        type=lambda text: tuple(positive_int(x) for x in text.split(",")))
