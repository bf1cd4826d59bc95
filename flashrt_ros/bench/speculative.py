"""Speculative decoding with the MTP layer against plain greedy decode, on the same weights.

    python -m flashrt_ros.bench.speculative [--device cpu] [--tokens 128] [--rounds 5] [--model DIR]

Every contender decodes the same request (a prompt, then ``--tokens`` greedy tokens) on one
engine per model, interleaved round by round; each figure is a median over the rounds and each
ratio is to plain decode of the same model in the same rounds. Per contender:

- tokens/s and its ratio to plain decode;
- acceptance (accepted drafts per draft) and tokens per pass (each pass reads the main model's
  weights once);
- the bandwidth figure: tokens/s x (weight bytes one decode step reads / copy bandwidth),
  which is 1.0 for a decode that reads its weights at the copy rate once per token, and above
  1.0 only when the weight-bandwidth limit of plain decode is beaten.

Models: the bench config with its seeded MTP head, which a random model's outputs leave
nothing to learn for (the cost of drafts that are always rejected, with and without the
switch-off), and known drafts of a set acceptance on it (``KnownDrafts``: the ceiling of a head
that good); then, where ``make spec-model`` has made it (or ``--model``), the bench-size byte
model trained on Python source with the head distilled from it (``flashrt-train-mtp``).
"""
from __future__ import annotations

import statistics
from pathlib import Path
from typing import Callable

import torch

from ..runtime import Engine, ModelConfig
from .known_drafts import KnownDrafts
from ..distill.train_lm import corpus
from ..distill.train_mtp import text_prompts
from .common import bench_main, copy_bandwidth, interleaved, machine, positive_int, timed, verdict

SPEC_MODEL = Path(__file__).resolve().parents[2] / "build" / "spec_model"
HEAD_FILE = "mtp_head.safetensors"


class _Request:
    """One contender: the same prompts, each followed by ``tokens`` tokens, on ``engine`` with one
    speculative setting; a call times the decodes of all of them (not the prefills)."""

    def __init__(self, engine: Engine, prompts: list[list[int]], tokens: int, drafts: int | None,
                 setup: Callable[[], None] = lambda: None) -> None:
        self.engine, self.prompts, self.tokens, self.drafts, self.setup = engine, prompts, tokens, drafts, setup
        self.passes = self.drafted = self.accepted = 0
        self.output: list[int] = []

    def __call__(self) -> float:
        e, seconds = self.engine, 0.0
        for prompt in self.prompts:
            e.reset()
            e.prefill(prompt)
            self.setup()
            before = e.speculation_stats
            seconds += timed(lambda: self.output.extend(e.generate(self.tokens, speculative=self.drafts)), e.device)
            after = e.speculation_stats
            if after is not None:
                self.passes += after.passes - before.passes
                self.drafted += after.drafted - before.drafted
                self.accepted += after.accepted - before.accepted
        return seconds


def _restarted(engine: Engine, drafter=None, break_even: float | None = None) -> Callable[[], None]:
    """A setup that gives each request the drafter and switch-off rule asked for, afresh."""
    spec = engine.speculation
    default_break_even = spec.break_even

    def setup() -> None:
        spec.restart()
        spec.drafter = drafter or spec.mtp_drafts
        spec.break_even = default_break_even if break_even is None else break_even

    return setup


def _measure(name: str, engine: Engine, contenders: dict[str, _Request], rounds: int,
             bandwidth: float) -> list[dict]:
    medians = interleaved(contenders, rounds)
    plain = contenders["plain"]
    weight_bytes = engine.model.weight_bytes_per_token()
    rows = []
    print(f"  {name}: {weight_bytes / 2**20:.0f} MiB of weights per decode step")
    print(f"    {'contender':34s} {'tokens/s':>9s} {'x plain':>8s} {'accept':>7s} {'tok/pass':>9s} {'bw fig':>7s}")
    for label, request in contenders.items():
        per_s = request.tokens * len(request.prompts) / medians[label]
        row = {"model": name, "contender": label, "tokens_per_s": per_s,
               "ratio": medians["plain"] / medians[label],
               "acceptance": request.accepted / request.drafted if request.drafted else None,
               "tokens_per_pass": (request.passes + request.accepted) / request.passes if request.passes else 1.0,
               "bandwidth_figure": per_s * weight_bytes / bandwidth,
               "same_tokens": request.output == plain.output}
        rows.append(row)
        accept = "" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"    {label:34s} {per_s:9.1f} {row['ratio']:8.2f} {accept:>7s} {row['tokens_per_pass']:9.2f} "
              f"{row['bandwidth_figure']:7.2f}{'' if row['same_tokens'] else '  TOKENS DIFFER'}")
    return rows


def _random_bench(device: torch.device, tokens: int, rounds: int, bandwidth: float) -> list[dict]:
    engine = Engine.from_config(ModelConfig.bench(), device=device, max_seq_len=1024)
    prompt = list(range(1, 17))
    engine.prefill(prompt)
    plain_tokens = engine.generate(tokens)
    contenders = {"plain": _Request(engine, [prompt], tokens, None)}
    for k in (1, 2):
        contenders[f"seeded head, k={k}, switch-off on"] = _Request(engine, [prompt], tokens, k, _restarted(engine))
        contenders[f"seeded head, k={k}, always on"] = _Request(engine, [prompt], tokens, k,
                                                                _restarted(engine, break_even=0.0))
    for wrong in (0.0, 0.2, 0.4):
        for k in (1, 3):
            known = KnownDrafts(engine.speculation, plain_tokens, len(prompt), wrong, engine.config.vocab_size)
            contenders[f"known drafts {1 - wrong:.0%} right, k={k}"] = _Request(
                engine, [prompt], tokens, k, _restarted(engine, drafter=known, break_even=0.0))
    try:
        return _measure("bench config (random weights)", engine, contenders, rounds, bandwidth)
    finally:
        engine.close()


def _trained(model: Path, device: torch.device, tokens: int, rounds: int, bandwidth: float) -> list[dict]:
    engine = Engine.from_pretrained(model, device=device, max_seq_len=1024, mtp_head=model / HEAD_FILE)
    # Prompts from the model's own domain that the head was not distilled on (train_mtp's
    # prompts are other slices of the same source).
    prompts = text_prompts(corpus(), 4, seed=1000)
    contenders = {"plain": _Request(engine, prompts, tokens, None)}
    for k in (1, 2, 3, 4):
        contenders[f"distilled head, k={k}"] = _Request(engine, prompts, tokens, k, _restarted(engine))
    try:
        return _measure(f"bench-size byte model trained on Python source ({model})", engine, contenders, rounds,
                        bandwidth)
    finally:
        engine.close()


def run(device: str = "cpu", tokens: int = 128, rounds: int = 5, model: Path | None = None) -> dict:
    dev = torch.device(device)
    print(f"speculative decoding: {tokens} tokens per request, {rounds} rounds, {machine()}")
    bandwidth = statistics.median(copy_bandwidth(256 << 20, dev) for _ in range(3))
    print(f"  copy bandwidth {bandwidth / 1e9:.1f} GB/s (bytes read + written)")
    rows = _random_bench(dev, tokens, rounds, bandwidth)
    model = model or SPEC_MODEL
    checks = []
    rejected = next(r for r in rows if r["contender"] == "seeded head, k=1, switch-off on")
    checks.append(verdict("useless head with the switch-off: tokens/s vs plain", rejected["ratio"], 0.9, True))
    if (model / HEAD_FILE).is_file():
        trained = _trained(model, dev, tokens, rounds, bandwidth)
        rows += trained
        best = max((r for r in trained if r["contender"] != "plain"), key=lambda r: r["ratio"])
        checks.append(verdict(f"trained bench-size model, {best['contender']}: tokens/s vs plain",
                              best["ratio"], 1.5, True))
        checks.append(verdict(f"trained bench-size model, {best['contender']}: bandwidth figure",
                              best["bandwidth_figure"], 1.0, True))
    else:
        print(f"  no trained model at {model}: `make spec-model` makes it (the trained-head targets are not measured)")
    if not all(r["same_tokens"] for r in rows):
        raise RuntimeError("a speculative contender decoded other tokens than plain decode")
    return {"machine": machine(), "device": device, "bandwidth": bandwidth, "rows": rows, "checks": checks}


if __name__ == "__main__":
    def _arguments(parser):
        parser.add_argument("--tokens", type=positive_int, default=128)
        parser.add_argument("--rounds", type=positive_int, default=5)
        parser.add_argument("--model", type=Path, default=None, help=f"trained model folder (default {SPEC_MODEL})")

    bench_main(__doc__, _arguments, lambda a: run(a.device, a.tokens, a.rounds, a.model))
