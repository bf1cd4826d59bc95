"""A released model's shape (random weights), loaded as a checkpoint folder is, measured side by
side in one run.

    python -m flashrt_ros.bench.released [--model Qwen3.5-0.8B] [--prompt 512] [--tokens 16]
                                         [--rounds 3] [--ttft 2048]

The shape is ``runtime.released.RELEASED[model]`` (its published config.json); the weights are
seeded, so nothing is downloaded. In order, each step freeing what it made:
1. load: ``Engine.from_pretrained`` of a bf16 checkpoint folder (a CPU computes in fp32, a GPU
   keeps bf16) / reading its files once, both from the page cache, interleaved (target <= 2);
   the peak resident memory once it is loaded;
2. parity with transformers (fp32, same weights): the largest difference of the prompt's last
   logits, and greedy tokens compared one by one;
3. prefill and decode tokens/s against transformers, and decode against the weight-bandwidth
   limit (``bench.runtime`` at this shape);
4. snapshot and restore against one plain copy of the same bytes, and the time to the first
   token from a capsule against a cold prefill (``bench.capsules`` at this shape); the
   fixed-size and per-token state bytes; decode greedy, sampled, and sampled within a
   top-k/top-p cut.
"""
from __future__ import annotations

import argparse
import gc
import resource
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..runtime import Engine, ModelConfig
from ..runtime.released import RELEASED
from ..runtime.weights import save_checkpoint, seeded_weights
from . import capsules, runtime
from .common import bench_main, interleaved, machine, positive_int, verdict

PARITY_PROMPT = 16
PARITY_TOKENS = 12


def config_of(model: str) -> ModelConfig:
    if model not in RELEASED:
        raise SystemExit(f"unknown model {model!r}: one of {', '.join(RELEASED)}")
    return ModelConfig.from_hf_config(RELEASED[model])


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def load_ratio(cfg: ModelConfig, rounds: int) -> dict:
    """Loading a bf16 checkpoint folder against reading its files once."""
    with tempfile.TemporaryDirectory() as folder:
        weights = {k: v.to(torch.bfloat16) for k, v in seeded_weights(cfg, seed=0).items()}
        save_checkpoint(folder, cfg, weights)
        del weights
        files = sorted(Path(folder).iterdir())
        nbytes = sum(f.stat().st_size for f in files)

        buffer = memoryview(bytearray(16 << 20))

        def read() -> float:
            # Into one buffer, as `cat` reads: a fresh object per read() would time the
            # allocator's page faults on it, not the reading.
            start = time.perf_counter()
            for f in files:
                with open(f, "rb", buffering=0) as stream:
                    while stream.readinto(buffer):
                        pass
            return time.perf_counter() - start

        def load() -> float:
            start = time.perf_counter()
            Engine.from_pretrained(folder, max_seq_len=64).close()
            return time.perf_counter() - start

        read()   # into the page cache: both sides read memory, not the disk of the moment
        engine = Engine.from_pretrained(folder, max_seq_len=64)
        dtype, peak = engine.dtype, peak_rss_gib()
        engine.close()
        t = interleaved({"read": read, "load": load}, rounds)
    print(f"  load: {nbytes / 2**30:.2f} GiB bf16 folder read in {t['read']:.3f} s, loaded in {t['load']:.2f} s "
          f"({t['load'] / t['read']:.2f}x), computing in {str(dtype).removeprefix('torch.')}; "
          f"peak RSS {peak:.2f} GiB")
    return {"file_bytes": nbytes, "read_s": t["read"], "load_s": t["load"], "dtype": str(dtype),
            "peak_rss_gib": peak}


def parity(cfg: ModelConfig) -> dict:
    """The largest difference of the last prompt position's logits, and greedy tokens, against
    transformers on the same fp32 weights."""
    with tempfile.TemporaryDirectory() as folder:
        save_checkpoint(folder, cfg, seeded_weights(cfg, seed=0))
        engine = Engine.from_pretrained(folder, max_seq_len=PARITY_PROMPT + PARITY_TOKENS + 4)
        hf = runtime._hf_model(folder, torch.device("cpu"))
    ids = torch.randint(0, cfg.vocab_size, (PARITY_PROMPT,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = engine.prefill(ids).float()
        out = hf(ids[None], use_cache=True)
        diff = float((ours - out.logits[0, -1].float()).abs().max())
        scale = float(out.logits[0, -1].float().abs().max())
        theirs, cache, nxt = [], out.cache, out.logits[:, -1:].argmax(-1)
        for _ in range(PARITY_TOKENS):
            theirs.append(int(nxt))
            out = hf(nxt, cache=cache, use_cache=True)
            cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    mine = [int(t) for t in engine.generate(PARITY_TOKENS)]
    same = sum(a == b for a, b in zip(mine, theirs))
    print(f"  parity: largest logit difference {diff:.2e} over the prompt's last position (the largest "
          f"logit {scale:.3g}: {diff / scale:.1e} of it); {same}/{PARITY_TOKENS} greedy tokens identical")
    engine.close()
    return {"max_logit_diff": diff, "max_logit": scale, "tokens_identical": same, "tokens": PARITY_TOKENS}


def draw_costs(engine: Engine, tokens: int, rounds: int) -> dict:
    """Decode ms/token greedy, drawn at a temperature, and drawn within a top-k/top-p cut (a sort
    of the vocabulary per token), each from the same state."""
    engine.reset()
    engine.prefill(torch.arange(64) % engine.config.vocab_size)
    start = engine.snapshot(pin=True)
    ways = {"greedy": {}, "sampled": {"temperature": 0.7}, "cut": {"temperature": 0.7, "top_k": 20, "top_p": 0.95}}

    def timing(how: dict) -> Callable[[], float]:
        def once() -> float:
            engine.restore(start)
            began = time.perf_counter()
            engine.generate(tokens, **how, seed=1)
            return (time.perf_counter() - began) / tokens * 1e3
        return once

    t = interleaved({name: timing(how) for name, how in ways.items()}, rounds)
    engine.capsules.drop(start)
    print(f"  decode ms/token: greedy {t['greedy']:.1f}, drawn at temperature 0.7 {t['sampled']:.1f}, "
          f"within top_k 20 / top_p 0.95 {t['cut']:.1f} ({t['cut'] / t['greedy']:.2f}x greedy)")
    return {"greedy_ms": t["greedy"], "sampled_ms": t["sampled"], "cut_ms": t["cut"]}


@torch.no_grad()
def run(model: str = "Qwen3.5-0.8B", prompt: int = 512, tokens: int = 16, rounds: int = 3,
        ttft: tuple[int, ...] = (2048,), cfg: ModelConfig | None = None) -> dict:
    """``cfg``: another shape, named ``model`` in the output (a test's small one)."""
    cfg = cfg or config_of(model)
    print(f"released shape {model} (random weights) on {machine()}")
    print("1. loading a bf16 checkpoint folder")
    loaded = load_ratio(cfg, rounds)
    print("2. parity with transformers (fp32)")
    matched = parity(cfg)
    gc.collect()   # each step's models freed before the next builds its own (2B in fp32 is 9 GB)
    print("3. prefill and decode against transformers")
    speed = runtime.run("cpu", prompt, tokens, rounds, cfg=cfg, label=model)
    gc.collect()
    print("4. capsules")
    with Engine.from_config(cfg, max_seq_len=max(ttft) + capsules.SUFFIX + 64) as engine:
        copies = capsules.copy_ratios(engine, [p for p in (256, 1024, 2048) if p <= max(ttft)], rounds)
        firsts = capsules.ttft(engine, list(ttft), rounds)
        sizes = capsules.size_account(engine)
        draws = draw_costs(engine, tokens, rounds)
    checks = [verdict(f"{model}: load / read its files", loaded["load_s"] / loaded["read_s"], 2.0, False)]
    checks += [dict(c, name=f"{model}: {c['name']}") for c in speed["checks"]]
    checks += [verdict(f"{model}: restore / copy at {r['bytes'] / 2**20:.1f} MiB", r["restore_ratio"], 1.3, False)
               for r in copies if r["bytes"] >= 4 * 2**20]
    return {"machine": machine(), "model": model, "load": loaded, "parity": matched, "runtime": speed,
            "copies": copies, "ttft": firsts, "sizes": sizes, "draws": draws, "peak_rss_gib": peak_rss_gib(),
            "checks": checks}


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="Qwen3.5-0.8B", choices=sorted(RELEASED))
        parser.add_argument("--prompt", type=positive_int, default=512)
        parser.add_argument("--tokens", type=positive_int, default=16)
        parser.add_argument("--rounds", type=positive_int, default=3)
        parser.add_argument("--ttft", type=lambda s: tuple(positive_int(x) for x in s.split(",")), default=(2048,))

    bench_main(__doc__, arguments, lambda a: run(a.model, a.prompt, a.tokens, a.rounds, a.ttft), device=False)


if __name__ == "__main__":
    main()
