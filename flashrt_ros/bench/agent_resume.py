"""An interrupted agent re-entering its task on a trained hybrid model: what each way of getting
its state back costs and gives.

    python -m flashrt_ros.bench.agent_resume [--contexts 20] [--context 3072] [--png FILE] [--json FILE]

The model is ``data/spec_tiny``, the embedded default's backbone (3 Gated DeltaNet layers and 1
attention layer) trained on 256-byte windows of the top-level ``.py`` files of the Python
standard library (``flashrt_ros.distill.train_lm``). Contexts are real text it never trained on:
the opening bytes of standard-library files in sub-packages, evenly spaced over their sorted
list (``contexts``), each far longer than the training window.

Per context:
1. uninterrupted: BOS + the context, a snapshot at the end (the interruption point), then
   ``resumed`` greedy tokens: the reference;
2. the interruption, as an agent serves a side request: appended to the same context, in the
   training data's own document boundary (EOS, BOS, then the opening bytes of another file),
   and answered with ``answer`` greedy tokens;
3. the recovery (timed), then ``resumed`` greedy tokens, compared position by position with the
   reference. Every mode starts from the same interrupted state (a full restore of the
   snapshot, then the interruption again), in an order shuffled per context.

Modes (``MODES``): (a) full restore of the snapshot; (b) KV-only (``regions=["kv"]``: the KV rows
and the position back; recurrent, conv, MTP state and the last hidden state as the interruption
left them, so the first token is chosen from that hidden state); (b') KV plus the meta group
(position, token log, last hidden state: the first token is chosen as uninterrupted, the
recurrent and conv state are still the interruption's); (c) everything but the KV (KV rows below
the interruption are never rewritten while the context only grows, so (c) equals (a) by
construction here); (d) no restore: the next tokens follow the side answer in the same context;
(d') no restore, the context's last ``cue`` tokens appended again as a re-entry cue; (e) reset,
then prefill of the context again (what a server without recurrent snapshots must do).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..capsule import CapsuleInfo
from ..resources import package_file
from ..runtime import Engine
from ..runtime.tokenizer import BOS, EOS
from .common import code_version, machine, timed

MODEL = "data/spec_tiny"
TRAINING_WINDOW = 256   # train_lm's --length for data/spec_tiny (make spec-tiny)

MODES: dict[str, str] = {
    "full": "(a) full restore",
    "kv": "(b) KV-only restore",
    "kv_meta": "(b') KV + meta restore",
    "no_kv": "(c) all but KV restored",
    "continue": "(d) no restore",
    "cue": "(d') no restore, tail again",
    "recompute": "(e) reset + prefill again",
}


@dataclass(frozen=True)
class Sizes:
    """Token counts of one interrupted context. ``context`` counts the BOS; the engine's KV holds
    ``max_seq_len`` rows, which must take the context, the interruption, the cue and the resume."""
    context: int = 3072
    side: int = 128
    answer: int = 64
    resumed: int = 64
    cue: int = 32
    max_seq_len: int = 4096

    def __post_init__(self) -> None:
        need = self.context + self.side + self.answer + self.cue + self.resumed
        if min(self.context, self.side, self.answer, self.resumed, self.cue) < 1 or self.cue >= self.context:
            raise ValueError(f"sizes must be positive and cue < context: {self}")
        if need > self.max_seq_len:
            raise ValueError(f"context + side + answer + cue + resumed = {need} exceeds max_seq_len={self.max_seq_len}")


@dataclass(frozen=True)
class Context:
    name: str
    tokens: list[int]   # BOS + the file's opening bytes
    side: list[int]     # EOS, BOS + another file's opening bytes: the side request


def held_out_files(min_bytes: int) -> list[Path]:
    """The standard library's ``.py`` files in sub-packages (train_lm trains on the top-level
    ones only) of at least ``min_bytes``, sorted by path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (p for p in root.rglob("*.py") if p.parent != root and "site-packages" not in p.parts)
    return sorted((p for p in files if p.stat().st_size >= min_bytes), key=lambda p: p.relative_to(root).as_posix())


def contexts(n: int, sizes: Sizes) -> list[Context]:
    """``n`` contexts from files evenly spaced over ``held_out_files``; each side request comes
    from the first file from halfway to the next pick on whose opening no context opens (files
    that start with one licence header are common, and which ones differs between Python
    builds), so no side request is another context's text."""
    files = held_out_files(sizes.context)
    if len(files) < 2 * n:
        raise ValueError(f"{n} contexts need {2 * n} standard-library files of {sizes.context} bytes, "
                         f"found {len(files)}")
    root = Path(sysconfig.get_paths()["stdlib"])
    owns = [files[i * len(files) // n] for i in range(n)]
    openings = {own.read_bytes()[:sizes.side - 2] for own in owns}
    out = []
    for i, own in enumerate(owns):
        start = (2 * i + 1) * len(files) // (2 * n)
        other = next((f for f in files[start:] + files[:start]
                      if f not in owns and f.read_bytes()[:sizes.side - 2] not in openings), None)
        if other is None:
            raise ValueError("no standard-library file opens unlike every context: no side request to take")
        out.append(Context(own.relative_to(root).as_posix(), [BOS, *own.read_bytes()[:sizes.context - 1]],
                           [EOS, BOS, *other.read_bytes()[:sizes.side - 2]]))
    return out


def _recoveries(engine: Engine, sizes: Sizes) -> dict[str, Callable[[CapsuleInfo, Context], object] | None]:
    """Each mode's recovery from the interrupted state, given the snapshot and the context
    (None: the mode recovers nothing)."""
    not_kv = sorted({r["group"] for r in engine.region_table} - {"kv"})
    return {
        "full": lambda capsule, ctx: engine.restore(capsule),
        "kv": lambda capsule, ctx: engine.restore(capsule, regions=["kv"]),
        "kv_meta": lambda capsule, ctx: engine.restore(capsule, regions=["kv", "meta"]),
        "no_kv": lambda capsule, ctx: engine.restore(capsule, regions=not_kv),
        "continue": None,
        "cue": lambda capsule, ctx: engine.prefill(ctx.tokens[-sizes.cue:]),
        "recompute": lambda capsule, ctx: (engine.reset(), engine.prefill(ctx.tokens)),
    }


@dataclass(frozen=True)
class Outcome:
    """One mode on one context."""
    matches: int             # resumed tokens equal to the reference's at the same index
    first_diff: int | None   # the first index that differs; None when all are equal
    seconds: float           # the recovery's wall time
    same_state: bool         # the live state's digest equals the snapshot's after the recovery


def _compare(tokens: list[int], reference: list[int]) -> tuple[int, int | None]:
    same = [a == b for a, b in zip(tokens, reference)]
    return sum(same), next((i for i, s in enumerate(same) if not s), None)


def resume_context(engine: Engine, ctx: Context, sizes: Sizes, order_seed: int = 0) -> dict[str, Outcome]:
    """Every mode on one context (see the module's docstring), in a seeded shuffled order."""
    recover = _recoveries(engine, sizes)
    engine.reset()
    engine.prefill(ctx.tokens)
    capsule = engine.snapshot()
    digest = engine.capsules.get(capsule.id).digest
    reference = engine.generate(sizes.resumed)
    modes = list(MODES)
    random.Random(order_seed).shuffle(modes)
    out = {}
    for mode in modes:
        engine.restore(capsule)
        engine.prefill(ctx.side)
        engine.generate(sizes.answer)
        recovery = recover[mode]
        seconds = timed(lambda: recovery(capsule, ctx), engine.device) if recovery else 0.0
        same_state = engine.state_digest() == digest
        matches, first = _compare(engine.generate(sizes.resumed), reference)
        out[mode] = Outcome(matches, first, seconds, same_state)
    engine.capsules.drop(capsule.id)
    return {mode: out[mode] for mode in MODES}


@dataclass
class Result:
    sizes: Sizes
    names: list[str]
    outcomes: list[dict[str, Outcome]]   # per context
    machine: str = field(default_factory=machine)

    @property
    def rows(self) -> list[dict]:
        """One summary row per mode (the table's, and the chart's)."""
        return [_row(mode, [o[mode] for o in self.outcomes], self.sizes.resumed, self._full_ms) for mode in MODES]

    @property
    def _full_ms(self) -> float:
        return statistics.median(o["full"].seconds for o in self.outcomes) * 1e3

    def table(self) -> str:
        s, n = self.sizes, len(self.outcomes)
        lines = [f"agent resume on {MODEL}: N={n} contexts of {s.context} tokens (training window {TRAINING_WINDOW}, "
                 f"KV capacity {s.max_seq_len}); side request {s.side} + answer {s.answer}; {s.resumed} resumed "
                 f"greedy tokens", f"  {self.machine}, Python {sys.version.split()[0]}",
                 f"  {'mode':<28} {'identical':>9} {'match':>6} {'(min)':>6} {'first diff':>11} "
                 f"{'resume ms':>10} {'x (a)':>7} {'state=snap':>10}"]
        for r in self.rows:
            first = "-" if r["first_diff_median"] is None else f"{r['first_diff_median']:g} ({r['differing']})"
            lines.append(f"  {r['label']:<28} {r['identical']:>5}/{n:<3} {r['match_share']:6.1%} {r['match_min']:6.1%} "
                         f"{first:>11} {r['resume_ms']:10.3f} {r['resume_x_full']:7.1f} {r['same_state']:>6}/{n:<3}")
        lines.append("  identical: runs whose resumed tokens all equal the uninterrupted run's; match: mean share "
                     "(min over contexts); first diff: median first differing index over the runs that differ "
                     "(their count); resume ms: median wall time of the recovery; state=snap: live state digest "
                     "equal to the snapshot's after it")
        return "\n".join(lines)


def _row(mode: str, outcomes: list[Outcome], resumed: int, full_ms: float) -> dict:
    firsts = [o.first_diff for o in outcomes if o.first_diff is not None]
    ms = statistics.median(o.seconds for o in outcomes) * 1e3
    shares = [o.matches / resumed for o in outcomes]
    return {"mode": mode, "label": MODES[mode], "contexts": len(outcomes),
            "identical": sum(o.first_diff is None for o in outcomes), "match_share": statistics.fmean(shares),
            "match_min": min(shares), "first_diff_median": statistics.median(firsts) if firsts else None,
            "differing": len(firsts), "resume_ms": ms, "resume_x_full": ms / full_ms if full_ms else float("nan"),
            "same_state": sum(o.same_state for o in outcomes)}


def run(n: int = 20, sizes: Sizes = Sizes(), model: str | Path | None = None, device: str = "cpu") -> Result:
    """The ablation over ``n`` contexts; ``model`` defaults to the shipped ``data/spec_tiny``."""
    picked = contexts(n, sizes)
    with Engine.from_pretrained(model or package_file(MODEL), device=device, max_seq_len=sizes.max_seq_len) as engine:
        outcomes = [resume_context(engine, ctx, sizes, order_seed=i) for i, ctx in enumerate(picked)]
    return Result(sizes, [c.name for c in picked], outcomes)


def draw(result: Result, path: Path) -> Path:
    """Two panels: the mean share of resumed tokens equal to the uninterrupted run's (with each
    context's share as a dot), and the median time to resume (log scale; (d) recovers nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result.rows
    x = range(len(rows))
    fig, (share, time) = plt.subplots(1, 2, figsize=(11, 4.2))
    share.bar(x, [r["match_share"] for r in rows], color="tab:green")
    for i, mode in enumerate(MODES):
        dots = [o[mode].matches / result.sizes.resumed for o in result.outcomes]
        share.plot([i] * len(dots), dots, "k.", alpha=0.35, markersize=4)
    share.set_ylabel(f"share of {result.sizes.resumed} resumed tokens = uninterrupted")
    share.set_ylim(0, 1.05)
    timed_rows = [(i, r) for i, r in zip(x, rows) if r["resume_ms"] > 0]
    time.bar([i for i, _ in timed_rows], [r["resume_ms"] for _, r in timed_rows], color="tab:blue")
    for i, r in zip(x, rows):
        if r["resume_ms"] == 0:
            time.annotate("nothing\nrecovered", (i, 0), xycoords=("data", "axes fraction"), xytext=(0, 4),
                          textcoords="offset points", ha="center", fontsize=7)
    time.set_yscale("log")
    time.set_ylabel("time to resume, median (ms)")
    for ax in (share, time):
        ax.set_xticks(list(x), [r["label"] for r in rows], rotation=30, ha="right", fontsize=8)
    s = result.sizes
    fig.suptitle(f"Agent resume on {MODEL}: N={len(result.outcomes)} contexts of {s.context} tokens, "
                 f"{s.side}+{s.answer}-token interruption\n{result.machine}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, default=20)
    parser.add_argument("--context", type=int, default=Sizes.context, help="tokens per context, BOS included")
    parser.add_argument("--model", help=f"checkpoint folder (default: the shipped {MODEL})")
    parser.add_argument("--png", type=Path, help="also draw the chart here")
    parser.add_argument("--json", type=Path, help="also write the rows and per-context outcomes here")
    args = parser.parse_args(argv)
    result = run(args.contexts, Sizes(context=args.context), args.model)
    print(result.table())
    if args.png:
        print(f"wrote {draw(result, args.png)}")
    if args.json:
        import json
        from dataclasses import asdict

        args.json.write_text(json.dumps({"rows": result.rows, "contexts": result.names, "sizes": asdict(result.sizes),
                                         "outcomes": [{m: asdict(o) for m, o in c.items()} for c in result.outcomes],
                                         "machine": result.machine, "code": code_version()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
