"""Shared measuring tools: interleaved timing, medians, memcpy bandwidth, a PASS/MISS line."""
from __future__ import annotations

import platform
import statistics
import time
from typing import Callable

import torch


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
    """Median of each timing function, called in turn A, B, A, B... so that drift on
    a shared machine hits every contender alike."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            samples[name].append(fn())
    return {name: statistics.median(vals) for name, vals in samples.items()}


def timed(fn: Callable[[], object], device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def copy_bandwidth(nbytes: int, device: torch.device, rounds: int = 7) -> float:
    """Bytes per second of one plain tensor copy of ``nbytes`` (bytes copied, not bytes moved)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return nbytes / statistics.median(timed(lambda: dst.copy_(src), device) for _ in range(rounds))


def verdict(name: str, value: float, target: float, higher_is_better: bool) -> dict:
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    print(f"  {'PASS' if ok else 'MISS'}  {name}: {value:.3g} (target {sign} {target})")
    return {"name": name, "value": value, "target": target, "pass": ok}
