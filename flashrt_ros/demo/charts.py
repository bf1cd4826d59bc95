"""The demo's two pictures: a timeline of operations and the TTFT comparison."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")  # files only; no display on a robot or in CI
import matplotlib.pyplot as plt  # noqa: E402

_COLOURS = {"generate": "tab:blue", "capsule": "tab:green", "policy": "tab:orange", "tree": "tab:purple",
            "node": "tab:gray"}


def timeline(steps: Sequence[dict], path: Path, title: str) -> Path:
    """One bar per step, at its start time and as long as it took."""
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(steps) + 1.6))
    for row, step in enumerate(steps):
        colour = _COLOURS.get(step["group"], "tab:gray")
        ax.barh(row, step["seconds"], left=step["start"], color=colour,
                edgecolor="black" if step["ok"] else "red", linewidth=0.6 if step["ok"] else 2)
        # Capsule operations take milliseconds: a marker keeps them visible on a seconds axis.
        ax.plot(step["start"] + step["seconds"] / 2, row, marker="D", color=colour, markeredgecolor="black")
        ms = step["seconds"] * 1e3
        ax.text(step["start"] + step["seconds"], row, f"  {ms:.1f} ms" if ms < 1000 else f"  {ms / 1e3:.2f} s",
                va="center", fontsize=8, color="black" if step["ok"] else "red")
    ax.set_yticks(range(len(steps)), [s["name"] for s in steps], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the node was started")
    ax.set_title(title, fontsize=10)
    ax.set_xlim(0, max(s["start"] + s["seconds"] for s in steps) * 1.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(handles, list(_COLOURS), loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def ttft_bars(cold_ms: float, capsule_ms: float, context: int, path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    bars = ax.bar([f"cold prefill\n({context} tokens)", "restore capsule\n+ first token"], [cold_ms, capsule_ms],
                  color=["tab:red", "tab:green"])
    for bar, value in zip(bars, (cold_ms, capsule_ms)):
        ax.text(bar.get_x() + bar.get_width() / 2, value, f"{value:.1f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{title}: {cold_ms / capsule_ms:.1f}x faster from the capsule", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
