"""The resume ablation: N seeded interrupted routes (``interruption.Interrupted``), each resumed
every way (``interruption.RESUMES``), with the trained waypoint policy, in this process.

python -m flashrt_ros.sim.resume_ablation [--episodes N] [--out DIR] prints the table (success
with a 95% Wilson interval, control periods until the arm heads for the right waypoint, time
to resume) and writes resume_ablation.png: success per resume, and time to resume against the
history length at the interruption.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import ablation_cli
from .arm import CONTROL_PERIOD_S, Arm
from .interruption import RESUMES, Interrupted, Resumed, run_interrupted, run_route
from .train_resume_policy import DEFAULT_OUT, open_policy

LABELS = {"full": "(a) full restore of the capsule",
          "kv": "(b) KV-only restore (regions=[\"kv\"])",
          "not_kv": "(c) all but the KV (recurrent, conv, meta)",
          "none": "(d) no restore",
          "recompute": "(e) recompute: reset, history fed again",
          "regive": "(f) reset, waypoints left given again"}
ABLATION_SEEDS = range(500, 600)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a success rate (95% for z = 1.96)."""
    if n <= 0:
        raise ValueError(f"an interval needs at least one trial, got n={n}")
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def median_periods(values: list[int | None]) -> str:
    """The median of control-period counts, where None (never) ranks above every count."""
    ranked = sorted(values, key=lambda v: math.inf if v is None else v)
    middle = ranked[(len(ranked) - 1) // 2]   # the lower median: always one of the values
    return "never" if middle is None else str(middle)


@dataclass
class Result:
    seeds: range
    runs: dict[str, list[Resumed]]   # per resume, one per seed
    uninterrupted: list[bool]        # per seed: its route run without the interruption, done in time

    def table(self) -> str:
        n = len(self.seeds)
        full = self.runs["full"]
        history = [r.history for r in full]
        left = [r.remaining for r in full]
        lines = [f"resume after an urgent request, N={n} interrupted routes (seeds {self.seeds.start}-"
                 f"{self.seeds.stop - 1}); the same routes uninterrupted: {sum(self.uninterrupted)}/{n} done",
                 f"  at the interruption: history {int(np.median(history))} observations (median; "
                 f"{min(history)}-{max(history)}), waypoints left 1/2/3: "
                 f"{left.count(1)}/{left.count(2)}/{left.count(3)}"
                 + (f", none left: {left.count(0)}" if left.count(0) else "")
                 + f"; urgent request {int(np.median([r.urgent_periods for r in full]))} periods (median)",
                 f"  {'resumed from':<44} {'success':>13} {'95% interval':>14} {'periods to heading':>19} "
                 f"{'time to resume':>15}"]
        for resume in RESUMES:
            runs = self.runs[resume]
            k = sum(r.success for r in runs)
            lo, hi = wilson(k, n)
            headed = sum(r.heading is not None for r in runs)
            ms = np.median([r.recovery_s for r in runs]) * 1e3
            lines.append(f"  {LABELS[resume]:<44} {k:>4}/{n} {k / n:5.0%} {f'[{lo:.0%}, {hi:.0%}]':>14} "
                         f"{median_periods([r.heading for r in runs]):>7} ({headed:>3} headed) {ms:>12.3f} ms")
        ratio = np.median([e.recovery_s / a.recovery_s for a, e in zip(full, self.runs["recompute"])])
        lines.append(f"  time to resume: median over episodes; recompute / full restore at the same history length: "
                     f"{ratio:.0f}x (median of per-episode ratios); control period {CONTROL_PERIOD_S * 1e3:.0f} ms")
        return "\n".join(lines)


def run(policy: str | Path = DEFAULT_OUT, seeds: range = ABLATION_SEEDS) -> Result:
    arm = Arm()
    runs: dict[str, list[Resumed]] = {resume: [] for resume in RESUMES}
    uninterrupted = []
    with open_policy(policy) as engine:
        for seed in seeds:
            episode = Interrupted.sample(seed, arm)
            uninterrupted.append(run_route(engine, arm, episode.route).success)
            for resume in RESUMES:
                runs[resume].append(run_interrupted(engine, arm, episode, resume))
    return Result(seeds, runs, uninterrupted)


def draw(result: Result, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(result.seeds)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    rates, errors = [], [[], []]
    for resume in RESUMES:
        k = sum(r.success for r in result.runs[resume])
        lo, hi = wilson(k, n)
        rates.append(k / n)
        errors[0].append(k / n - lo)
        errors[1].append(hi - k / n)
    names = [LABELS[r].split(")")[0] + ")" for r in RESUMES]
    left.bar(names, rates, yerr=errors, capsize=4, color=["tab:green", "tab:red", "tab:orange", "tab:red",
                                                          "tab:blue", "tab:gray"])
    left.set_ylim(0, 1.05)
    left.set_ylabel(f"resumed routes done (N={n}, 95% Wilson interval)")
    left.set_title("success per resume", fontsize=10)
    for resume, marker in zip(("full", "kv", "not_kv", "recompute", "regive"), "o^sDv"):
        runs = result.runs[resume]
        right.scatter([r.history for r in runs], [r.recovery_s * 1e3 for r in runs], s=12, marker=marker,
                      label=LABELS[resume])
    right.axhline(CONTROL_PERIOD_S * 1e3, color="0.5", lw=0.8, ls="--", label="one control period")
    right.set_yscale("log")
    right.set_xlabel("observations in the state at the interruption")
    right.set_ylabel("time to resume (ms, wall)")
    right.set_title("time to resume ((d) recovers nothing)", fontsize=10)
    right.legend(fontsize=7, loc="center right")
    fig.tight_layout()
    path = out / "resume_ablation.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    return ablation_cli.main(argv, "python -m flashrt_ros.sim.resume_ablation", __doc__, DEFAULT_OUT, ABLATION_SEEDS,
                             run, draw)


if __name__ == "__main__":
    sys.exit(main())
