"""The retry ablation as task success: N seeded episodes whose first attempt is jammed, retried
from each kind of state (``rollout.RETRIES``), with the trained policy, in this process.

python -m flashrt_ros.sim.ablation [--episodes N] [--out DIR] prints the success table and
writes retry_paths.png: the end effector's path in one episode under each retry.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..runtime import Engine
from . import ablation_cli
from .arm import CONTROL_PERIOD_S, Arm
from .rollout import RETRIES, Attempt, with_retry
from .task import Episode

# What each retry starts from, in the table's words.
LABELS = {"full": "(a) full restore of the snapshot", "kv": "(b) KV-only restore (regions=[\"kv\"])",
          "reset": "(c) reset policy, never saw the goal", "continue": "(d) no rollback"}
ABLATION_SEEDS = range(500, 520)


@dataclass
class Result:
    seeds: range
    first_failures: int
    successes: dict[str, int]
    paths: dict[str, tuple[Attempt, Attempt]]   # of the first seed
    step_ms: list[float]                        # every policy step's time, in ms

    def table(self) -> str:
        n = len(self.seeds)
        lines = [f"retry success over N={n} episodes, seeds {self.seeds.start}-{self.seeds.stop - 1} "
                 f"(first attempt jammed: {self.first_failures}/{n} failed)"]
        lines += [f"  {LABELS[r]:<40} {self.successes[r]:>3}/{n}  {self.successes[r] / n:5.0%}" for r in RETRIES]
        p50, p99 = np.percentile(self.step_ms, [50, 99])
        lines.append(f"  policy step (engine.step, this process): median {p50:.2f} ms, p99 {p99:.2f} ms over "
                     f"{len(self.step_ms)} steps, against a control period of {CONTROL_PERIOD_S * 1e3:.0f} ms")
        return "\n".join(lines)


class _Timed:
    """The engine, its ``step`` timed (everything else passed through)."""

    def __init__(self, engine: Engine) -> None:
        self._engine, self.ms = engine, []

    def step(self, observation):
        started = time.perf_counter()
        action = self._engine.step(observation)
        self.ms.append((time.perf_counter() - started) * 1e3)
        return action

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


def run(policy: str | Path, seeds: range = ABLATION_SEEDS) -> Result:
    engine = _Timed(Engine.from_pretrained(policy, max_seq_len=256))
    arm = Arm()
    successes = {r: 0 for r in RETRIES}
    failures, paths = 0, {}
    try:
        for seed in seeds:
            episode = Episode.sample(seed)
            for retry in RETRIES:
                first, second = with_retry(engine, arm, episode, retry)
                failures += retry == RETRIES[0] and not first.success
                successes[retry] += second.success
                if seed == seeds.start:
                    paths[retry] = (first, second)
    finally:
        engine.close()
    return Result(seeds, failures, successes, paths, engine.ms)


def draw(result: Result, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    episode = Episode.sample(result.seeds.start)
    fig, axes = plt.subplots(1, len(RETRIES), figsize=(4 * len(RETRIES), 4.2), sharex=True, sharey=True)
    for ax, retry in zip(axes, RETRIES):
        first, second = result.paths[retry]
        ax.plot(*zip(*first.path), color="0.6", label="jammed attempt")
        ax.plot(*zip(*second.path), color="tab:blue" if second.success else "tab:red", label="retry")
        ax.plot(*first.path[0], "ko", ms=4, label="start")
        ax.plot(episode.goal[0], episode.goal[1], "g*", ms=12, label="goal")
        ax.set_title(f"{LABELS[retry]}\n{'reached' if second.success else 'missed'}", fontsize=9)
        ax.set_aspect("equal")
        ax.set_xlim(-0.8, 0.8)
        ax.set_ylim(-0.8, 0.8)
    axes[0].legend(fontsize=7, loc="lower left")
    fig.suptitle(f"end-effector paths, episode seed {episode.seed}", fontsize=10)
    fig.tight_layout()
    path = out / "retry_paths.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    from .train_policy import DEFAULT_OUT

    return ablation_cli.main(argv, "python -m flashrt_ros.sim.ablation", __doc__, DEFAULT_OUT, ABLATION_SEEDS, run, draw)


if __name__ == "__main__":
    sys.exit(main())
