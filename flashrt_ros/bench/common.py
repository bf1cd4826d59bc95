"""Shared measuring tools: interleaved timing, medians, memcpy bandwidth, a PASS/MISS line,
and the command line every benchmark module has."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
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


def interleaved(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median of each timing function, called in turn A, B, C, then B, C, A... so that drift
    on a shared machine hits every contender alike, and each one runs after each of the
    others equally often (what ran just before, e.g. a digest on the other core or a cache
    that a big copy emptied, changes a sub-millisecond timing)."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    for r in range(rounds):
        for name, fn in order[r % len(order):] + order[:r % len(order)]:
            samples[name].append(fn())
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
    and made copies from it up to 1.5x too fast. Huge pages where the engine uses them too."""
    src = empty_huge((nbytes,), torch.uint8, device).fill_(1)
    return src, empty_huge((nbytes,), torch.uint8, device).fill_(2)


def copy_bandwidth(nbytes: int, device: torch.device, rounds: int = 7) -> float:
    """Bytes per second of one plain tensor copy of ``nbytes`` (bytes copied, not bytes moved)."""
    src, dst = copy_pair(nbytes, device)
    dst.copy_(src)
    return nbytes / statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(rounds))


def matmul_rate(device: torch.device, size: int = 1024, rounds: int = 9) -> float:
    """FLOP/s of the fastest of ``rounds`` square fp32 matrix products: about the most this
    device does with any kernel, for bounds (the fastest round, since noise only slows)."""
    a = torch.randn(size, size, device=device)
    b, out = torch.randn_like(a), torch.empty_like(a)
    torch.mm(a, b, out=out)
    return 2 * size ** 3 / min(timed(lambda: torch.mm(a, b, out=out), device) for _ in range(rounds))


def verdict(name: str, value: float, target: float, higher_is_better: bool) -> dict:
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    print(f"  {'PASS' if ok else 'MISS'}  {name}: {value:.3g} (target {sign} {target})")
    return {"name": name, "value": value, "target": target, "pass": ok}


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
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def add_ttft_prefixes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ttft", default="2048,4096,8192,16384", help="prefix lengths, comma-separated",
                        type=lambda text: tuple(int(x) for x in text.split(",")))
