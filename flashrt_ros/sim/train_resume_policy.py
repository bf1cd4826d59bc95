"""make train-resume-policy: clone the waypoint policy and export a checkpoint the engine loads.

The model is the reaching policy's (``train_policy``: the embedded default's backbone with the
observation projector and the action head, trained as transformers' ``Qwen3_5ForCausalLM``), the
data the waypoint task's (``route_demonstrations``): the expert's routes driven with noise
(DART), then rounds of DAgger in which the policy drives, urgent requests and resumes included.
Sequences differ in length: a batch is padded at the end and the loss masked to the real steps.
The Gated DeltaNet's rule runs in the package's C kernel where it is built
(``backends.cpu.delta_train``), transformers' chunked form where it is not.

Deterministic for a seed on one machine and thread count, with the kernel or without it; another
CPU, or the other rule, may round differently and end at another checkpoint.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from ..runtime import Engine
from ..runtime.backends.cpu import delta_train
from .arm import Arm
from .interruption import run_route
from .route_demonstrations import Sequences, demonstrate
from .train_policy import actions, build, export, policy_config
from .waypoints import Route

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "data" / "policies" / "waypoints_arm"
TRAIN_SEEDS = range(20_000, 22_000)
DAGGER_EPISODES = 400
HELD_OUT_SEEDS = range(0, 100)   # uninterrupted routes, never trained on (the ablation's are 500 on)
MAX_SEQ_LEN = 256                # the engine's context: a route, resumed, is well inside it


def open_policy(path: str | Path) -> Engine:
    """The engine a waypoint policy runs in: one thread per step, since a one-row step has too
    little work to share, and a thread that waits for a busy core stalls the step."""
    return Engine.from_pretrained(path, max_seq_len=MAX_SEQ_LEN, decode_threads=1)


def masked_mse(predicted: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean squared error over the real steps (``mask`` 1) only."""
    per_step = ((predicted - target) ** 2).mean(dim=-1)
    return (per_step * mask).sum() / mask.sum()


class Scale:
    """Each observation feature shifted and scaled by its mean and spread over the expert's
    demonstrations, for training only: a goal's coordinates (a few tenths, on one period in
    twenty) then weigh on the optimiser as much as the joint velocities (several rad/s).
    ``folded`` moves it into the observation projector, so that the checkpoint takes raw
    observations, as the engine gives them."""

    def __init__(self, data: Sequences) -> None:
        rows = np.concatenate(data.observations)
        spread = rows.std(axis=0)
        self.mean = torch.from_numpy(rows.mean(axis=0))
        self.std = torch.from_numpy(np.where(spread > 1e-6, spread, 1.0).astype(np.float32))   # constant features stay

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        return (observations - self.mean) / self.std


def folded(model: torch.nn.ModuleDict, scale: Scale) -> torch.nn.ModuleDict:
    """A copy of ``model`` whose observation projector takes raw observations: W x' + b with
    x' = (x - mean) / std is (W / std) x + (b - (W / std) mean)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        projector = out["obs_proj"]
        projector.weight.div_(scale.std)
        projector.bias.sub_(projector.weight @ scale.mean)
    return out


def length_batches(data: Sequences, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The rows of ``data`` in batches of about one length (``batch`` rows each, the last
    smaller): a batch is padded to its longest sequence, so batches of mixed lengths would
    spend most of their work on padding. A little noise on the lengths before sorting mixes
    the neighbours that share a batch from one call to the next."""
    lengths = np.array([len(o) for o in data.observations], dtype=np.float64)
    order = np.argsort(lengths + rng.uniform(0.0, 4.0, size=len(lengths)), kind="stable")
    return [order[i:i + batch] for i in range(0, len(order), batch)]


def train(seed: int = 0, iterations: int = 2800, rounds: int = 3, batch: int = 24, lr: float = 2e-3,
          ema: float | None = 0.999, chunk: int | None = 16, delta_kernel: bool = True, log_every: int = 100,
          ) -> tuple[torch.nn.ModuleDict, list[tuple[int, float]], dict[str, float]]:
    """The trained model (taking raw observations), (iteration, loss) at every ``log_every``, and
    seconds per phase: ``iterations`` on the expert's demonstrations, then ``rounds`` of DAgger,
    each adding the episodes the policy of the round before drives and training ``iterations`` more.
    ``ema``: the policy (that drives the DAgger rounds and is returned) is the exponential moving
    average of the weights with this decay per step (None: the last step's weights). ``chunk``: the
    chunk length of transformers' chunked Gated DeltaNet (None: its default, 64). These
    sequences are mostly 20 to 70 steps, so much of a 64-step chunk is padding, and each chunk
    costs a 64-wide triangular solve forward and backward; the chunked form is exact for any
    length, so a shorter chunk changes only the rounding. ``delta_kernel``: run the rule by the
    package's C kernel where it is built (``backends.cpu.delta_train``: the same function in
    fewer, larger operations, rounded otherwise), not by transformers' chunked form."""
    took = {"demonstrations": 0.0, "dagger": 0.0, "training": 0.0}
    started = time.monotonic()
    data = demonstrate(TRAIN_SEEDS)
    scale = Scale(data)
    took["demonstrations"] = time.monotonic() - started
    model = build(policy_config(), seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    average = None if ema is None else AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema))
    policy = model if average is None else average.module
    rng = np.random.default_rng(seed)
    losses: list[tuple[int, float]] = []
    total = iterations * (rounds + 1)
    batches = length_batches(data, batch, rng)
    with delta_train.replacing_transformers() if delta_kernel else contextlib.nullcontext():
        for it in range(total):
            if it and it % iterations == 0:   # a DAgger round: the policy so far drives, the expert labels
                started = time.monotonic()
                first = TRAIN_SEEDS.stop + (it // iterations - 1) * DAGGER_EPISODES
                data = data + _driven_by(folded(policy, scale), first)
                batches = length_batches(data, batch, rng)
                took["dagger"] += time.monotonic() - started
            started = time.monotonic()
            for group in opt.param_groups:   # cosine decay to a tenth
                group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / total)))
            loss = gradient_step(model, opt, scale, data.padded(batches[rng.integers(0, len(batches))]), chunk)
            if average is not None:
                average.update_parameters(model)
            if it % log_every == 0 or it == total - 1:
                losses.append((it, loss.item()))
            took["training"] += time.monotonic() - started
    return folded(policy, scale), losses, took


def gradient_step(model: torch.nn.ModuleDict, opt: torch.optim.Optimizer, scale: Scale,
                  batch: tuple[np.ndarray, np.ndarray, np.ndarray], chunk: int | None) -> torch.Tensor:
    """One step of ``opt`` on a padded batch (observations, targets, mask): the masked loss,
    gradients clipped to norm 1. Returns the loss."""
    x, y, mask = (torch.from_numpy(a) for a in batch)
    loss = masked_mse(actions(model, scale(x), chunk), y, mask)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], 1.0)
    opt.step()
    return loss


def _driven_by(model: torch.nn.ModuleDict, first_seed: int) -> Sequences:
    with tempfile.TemporaryDirectory() as folder:
        export(model, Path(folder))
        with open_policy(folder) as engine:
            return demonstrate(range(first_seed, first_seed + DAGGER_EPISODES), policy=engine)


def success_rate(path: Path, seeds: range = HELD_OUT_SEEDS) -> float:
    """Uninterrupted routes the exported policy completes in time, run by the engine."""
    arm = Arm()
    with open_policy(path) as engine:
        return sum(run_route(engine, arm, Route.sample(s)).success for s in seeds) / len(seeds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make train-resume-policy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"checkpoint folder (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=2800, help="iterations per round (default 2800)")
    parser.add_argument("--rounds", type=int, default=3, help="DAgger rounds after the first (default 3)")
    parser.add_argument("--batch", type=int, default=24, help="sequences per gradient step (default 24)")
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, cosine to a tenth (default 2e-3)")
    parser.add_argument("--ema", type=float, default=0.999,
                        help="ship the moving average of the weights, with this decay per step (default 0.999; 0: "
                             "the last step's weights)")
    parser.add_argument("--chunk", type=int, default=16,
                        help="the Gated DeltaNet's chunk in training where transformers' chunked form runs it "
                             "(default 16; transformers' own is 64)")
    parser.add_argument("--delta-kernel", action=argparse.BooleanOptionalAction, default=True,
                        help="run the delta rule by the package's C kernel where it is built (default: yes)")
    parser.add_argument("--threads", type=int, default=2,
                        help="torch threads (default 2, whatever the machine's cores: the checkpoint depends on "
                             "the thread count, which splits the sums)")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.batch < 1:
        parser.error("--threads and --batch must be at least 1")
    if not 0 < args.lr < 1:
        parser.error("--lr must be in (0, 1)")
    if args.chunk < 1:
        parser.error("--chunk must be at least 1")
    if not 0 <= args.ema < 1:
        parser.error("--ema must be in [0, 1)")
    torch.set_num_threads(args.threads)
    started, cpu = time.monotonic(), time.process_time()
    model, losses, took = train(args.seed, args.iterations, args.rounds, args.batch, args.lr,
                                ema=args.ema or None, chunk=args.chunk, delta_kernel=args.delta_kernel)
    wall, cpu = time.monotonic() - started, time.process_time() - cpu
    for it, loss in losses:
        print(f"iteration {it:5d}  loss {loss:.5f}")
    export(model, args.out)
    rate = success_rate(args.out)
    phases = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in took.items())
    rule = ("the package's C kernel" if args.delta_kernel and delta_train.available()
            else f"transformers' chunked form ({args.chunk}-step chunks)")
    print(f"trained in {wall:.0f} s ({phases}; {cpu:.0f} s of CPU) on {torch.get_num_threads()} threads: "
          f"final loss {losses[-1][1]:.5f}, held-out success {rate:.0%} of {len(HELD_OUT_SEEDS)} "
          f"uninterrupted routes; the delta rule by {rule}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
