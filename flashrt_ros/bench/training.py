"""The waypoint policy's gradient step with its delta rule run by the package's C kernel
(``backends.cpu.delta_train``) against transformers' chunked form, side by side in one run: the
ratio that kernel earns its place with.

    python -m flashrt_ros.bench.training [--rounds N] [--steps S] [--threads T] [--json FILE]

Both contenders train their own copy of one model on the same batches (the expert's routes,
padded as ``make train-resume-policy`` pads them), on ``threads`` torch threads (training's two
by default, whatever the machine).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable

import numpy as np
import torch

from ..runtime.backends.cpu import delta_train
from ..sim.route_demonstrations import demonstrate
from ..sim.train_policy import build, policy_config
from ..sim.train_resume_policy import TRAIN_SEEDS, Scale, gradient_step, length_batches
from .common import bench_main, interleaved, machine, positive_int

ROUTES = 200
BATCH = 24
CHUNK = 16   # the chunk training gives transformers' form


def run(rounds: int = 5, steps: int = 20, threads: int = 2, routes: int = ROUTES) -> dict | None:
    """Seconds per gradient step each way (medians of ``rounds`` interleaved rounds of ``steps``
    steps, on batches drawn from ``routes`` of the expert's routes), or None where the kernel is
    not built."""
    if not delta_train.available():
        print("== training step: skipped (the package's C library is not built)")
        return None
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        data = demonstrate(range(TRAIN_SEEDS.start, TRAIN_SEEDS.start + routes))
        scale = Scale(data)
        rng = np.random.default_rng(0)
        batches = length_batches(data, BATCH, rng)
        drawn = [data.padded(batches[i]) for i in rng.integers(0, len(batches), steps)]
        lengths = [batch[0].shape[1] for batch in drawn]

        def contender(kernel: bool) -> Callable[[], float]:
            model = build(policy_config(), seed=0)
            opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)

            def once() -> float:
                with delta_train.replacing_transformers() if kernel else contextlib.nullcontext():
                    start = time.perf_counter()
                    for batch in drawn:
                        gradient_step(model, opt, scale, batch, CHUNK)
                    return (time.perf_counter() - start) / steps
            once()   # warm: the first steps allocate what the rest reuse
            return once

        t = interleaved({"kernel": contender(True), "transformers": contender(False)}, rounds)
        where = machine()   # with training's thread count
    finally:
        torch.set_num_threads(before)
    ratio = t["transformers"] / t["kernel"]
    print(f"== training step ({where}): batches of {BATCH} routes, "
          f"{min(lengths)}-{max(lengths)} steps long")
    print(f"  delta rule by the kernel: {t['kernel'] * 1e3:.1f} ms a step; by transformers' chunked form "
          f"({CHUNK}-step chunks): {t['transformers'] * 1e3:.1f} ms ({ratio:.2f}x)")
    return {"kernel_step_s": t["kernel"], "transformers_step_s": t["transformers"], "ratio": ratio,
            "threads": threads, "steps": steps, "rounds": rounds}


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rounds", type=positive_int, default=5)
        parser.add_argument("--steps", type=positive_int, default=20)
        parser.add_argument("--threads", type=positive_int, default=2)

    bench_main(__doc__, arguments, lambda args: run(args.rounds, args.steps, args.threads) or {}, device=False)


if __name__ == "__main__":
    main()
