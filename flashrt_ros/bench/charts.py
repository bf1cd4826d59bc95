"""PNG charts of one ``make bench`` run (matplotlib, files only)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAPER = {2048: 3.9, 16384: 27.0}  # the paper's TTFT speed-ups, drawn as reference points


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def copies(rows: list[dict], path: Path, machine: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    mib = [r["bytes"] / 2**20 for r in rows]
    ax.plot(mib, [r["snapshot_ratio"] for r in rows], "o-", label="snapshot / plain copy")
    ax.plot(mib, [r["restore_ratio"] for r in rows], "s-", label="restore / plain copy")
    if all("return_ratio" in r for r in rows):
        ax.plot(mib, [r["return_ratio"] for r in rows], "^:", label="return to a capsule the state descends from")
    if all("views_ratio" in r for r in rows):
        ax.plot(mib, [r["views_ratio"] for r in rows], "x--", color="gray",
                label="torch views + one batched copy, no bookkeeping")
    ax.axhline(1.3, color="red", linestyle="--", linewidth=1, label="target 1.3 (from 1 MiB)")
    ax.set_xscale("log")
    ax.set_xlabel("live state (MiB)")
    ax.set_ylabel("time / memcpy of the same bytes")
    ax.set_title(f"Capsule copies vs memcpy\n{machine}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def ttft(ours: list[dict], transformers: list[dict], path: Path, machine: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([r["prefix"] for r in ours], [r["speedup"] for r in ours], "o-", label="flashrt_ros: restore capsule")
    if transformers:
        ax.plot([r["prefix"] for r in transformers], [r["speedup"] for r in transformers], "s-",
                label="transformers: deepcopy of a prefilled cache")
    ax.plot(list(PAPER), list(PAPER.values()), "k*", markersize=12, label="paper (3.9x at 2k, 27x at 16k)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("reused prefix (tokens), + 64 new tokens")
    ax.set_ylabel("TTFT cold / TTFT with reuse")
    ax.set_title(f"Time to first token: speed-up from reusing the prefix\n{machine}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)


def runtime(result: dict, path: Path, machine: str) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(8, 3.6))
    decode = result["decode_ms_per_token"]
    left.bar(["ours", "transformers", "weight-bandwidth\nlimit"],
             [decode["ours"], decode["transformers"], result["limit_ms_per_token"]],
             color=["tab:green", "tab:gray", "tab:blue"])
    left.set_ylabel("decode ms / token")
    prefill = result["prefill_tokens_per_s"]
    right.bar(["ours", "transformers"], [prefill["ours"], prefill["transformers"]], color=["tab:green", "tab:gray"])
    right.set_ylabel("prefill tokens / s")
    fig.suptitle(f"Decode and prefill, ModelConfig.bench() fp32\n{machine}", fontsize=9)
    return _save(fig, path)


def services(result: dict, path: Path, machine: str) -> Path:
    cross = result["modes"]["cross_process"]
    kinds = ["restore", "snapshot"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    x = range(len(kinds))
    ax.bar([i - 0.2 for i in x], [cross[k]["overhead_p50"] for k in kinds], width=0.4, label="overhead p50")
    ax.bar([i + 0.2 for i in x], [cross[k]["overhead_p99"] for k in kinds], width=0.4, label="overhead p99")
    ax.axhline(cross["bare_trigger"]["round_trip_p50"], color="gray", linestyle=":",
               label="bare rclpy Trigger round trip p50")
    ax.axhline(0.5, color="red", linestyle="--", linewidth=1, label="target p50 0.5 ms")
    ax.axhline(2.0, color="darkred", linestyle="--", linewidth=1, label="target p99 2 ms")
    ax.set_xticks(list(x), kinds)
    ax.set_ylabel("round trip - engine time (ms)")
    ax.set_title(f"ROS service overhead, node in another process\n{machine}", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, path)


def fork_memory(rows: list[dict], path: Path, machine: str) -> Path:
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    n = [r["branches"] for r in rows]
    ax.plot(n, [r["bytes"] / 2**20 for r in rows], "o-", label="forks sharing the prefix (this store)")
    ax.plot(n, [r["full_copies_bytes"] / 2**20 for r in rows], "s--", label="full copies of the state")
    ax.set_xlabel("branches explored (4 decode steps each, 4k-token context)")
    ax.set_ylabel("capsule memory (MiB)")
    ax.set_title(f"Fork memory\n{machine}", fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, path)
