"""Prompt reuse in transformers vs capsules here, and the memory of forked branches.

    python -m flashrt_ros.bench.reuse [--ttft 2048,4096,8192,16384] [--rounds 2]

1. transformers on the same ``ModelConfig.bench()`` weights: TTFT of a cold
   prefill of P + 64 tokens vs its documented reuse pattern (deepcopy of a
   cache prefilled with the P-token prefix, then the 64-token suffix), each up
   to its first token (the argmax of the last logits), as in the capsule
   benchmark. Our engine's cold prefill of the same tokens runs in the same
   rounds: the capsule benchmark's cold figure comes from another module,
   minutes away, and this VM's speed was seen to move 2x within a session.
2. Fork memory: N branches explored from one 4k-token context (fork, restore,
   4 decode steps, snapshot the branch's end) vs N full copies of the state.
"""
from __future__ import annotations

import copy
import tempfile
import time

import torch

from ..runtime import Engine, ModelConfig
from ..runtime.weights import save_checkpoint, seeded_weights
from .common import add_ttft_prefixes, bench_main, interleaved, machine, positive_int, timed

SUFFIX = 64


def transformers_ttft(prefixes: tuple[int, ...], rounds: int, device: torch.device) -> list[dict]:
    from .runtime import _hf_model

    cfg = ModelConfig.bench()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, cfg, seeded_weights(cfg, seed=0))
        hf = _hf_model(tmp, device)
        ours = Engine.from_pretrained(tmp, device=str(device), max_seq_len=max(prefixes) + SUFFIX)
    suffix = torch.randint(0, cfg.vocab_size, (1, SUFFIX), generator=torch.Generator().manual_seed(1)).to(device)
    rows = []
    for prefix in prefixes:
        ids = torch.randint(0, cfg.vocab_size, (1, prefix), generator=torch.Generator().manual_seed(prefix))
        ids = ids.to(device)
        prompt = torch.cat([ids, suffix], 1)
        # Same weights, same tokens: both cold prefills must find the same first token, or
        # their times compare different work.
        firsts: dict[str, int] = {}
        with torch.inference_mode():
            # logits_to_keep=1 throughout, as generate() does: only the last row is used.
            prefilled = hf(ids, use_cache=True, logits_to_keep=1).cache

            def first_token(out) -> int:
                return int(out.logits[0, -1].argmax())

            def cold() -> float:
                return timed(lambda: firsts.update(theirs=first_token(hf(prompt, use_cache=True, logits_to_keep=1))),
                             device)

            def reuse() -> float:
                return timed(lambda: first_token(hf(suffix, cache=copy.deepcopy(prefilled), use_cache=True,
                                                    logits_to_keep=1)), device)

            def ours_cold() -> float:
                ours.reset()   # off the clock, as in the capsule benchmark
                return timed(lambda: firsts.update(ours=int(ours.prefill(prompt[0]).argmax())), device)

            reuse()   # untimed: the first call at a new length runs slower
            t = interleaved({"cold": cold, "reuse": reuse, "ours_cold": ours_cold}, rounds)
        same = firsts["ours"] == firsts["theirs"]
        rows.append({"prefix": prefix, "cold_ms": t["cold"] * 1e3, "reuse_ms": t["reuse"] * 1e3,
                     "speedup": t["cold"] / t["reuse"], "ours_cold_ms": t["ours_cold"] * 1e3,
                     "ours_cold_vs_transformers": t["ours_cold"] / t["cold"], "same_first_token": same})
        print(f"  transformers P={prefix:6d}: cold {t['cold'] * 1e3:9.1f} ms   deepcopy reuse "
              f"{t['reuse'] * 1e3:8.1f} ms   x{rows[-1]['speedup']:.1f}   ours cold {t['ours_cold'] * 1e3:9.1f} ms "
              f"= {rows[-1]['ours_cold_vs_transformers']:.2f}x theirs{'' if same else ', ANOTHER FIRST TOKEN'}")
    ours.close()
    return rows


def fork_memory(branches: tuple[int, ...] = (1, 2, 4, 8, 16), context: int = 4096, steps: int = 4,
                device: str = "cpu") -> list[dict]:
    engine = Engine.from_config(ModelConfig.bench(), device=device, max_seq_len=context + 64,
                                budgets={"device": 4 << 30})
    engine.prefill(torch.randint(0, 32768, (context,), generator=torch.Generator().manual_seed(7)))
    root = engine.snapshot(pin=True)
    full = engine.capsules.get(root.id).nbytes
    rows = []
    for n in branches:
        before = engine.capsules.used_bytes("device")
        made = []
        for _ in range(n):
            fork = engine.fork(root)
            engine.restore(fork)
            engine.generate(steps)
            made += [fork, engine.snapshot()]
        used = engine.capsules.used_bytes("device") - before
        rows.append({"branches": n, "bytes": used, "full_copies_bytes": n * full, "ratio": used / (n * full)})
        print(f"  {n:3d} branches x {steps} steps from a {context}-token context: {used / 2**20:8.2f} MiB "
              f"vs {n * full / 2**20:8.1f} MiB as full copies ({rows[-1]['ratio']:.4f})")
        for capsule in made:
            engine.capsules.drop(capsule)
    engine.close()
    return rows


def run(prefixes: tuple[int, ...] = (2048, 4096, 8192, 16384), rounds: int = 2, device: str = "cpu") -> dict:
    dev = torch.device(device)
    print(f"prompt reuse and fork memory on {machine()}")
    return {"machine": machine(), "device": str(dev), "time": time.time(),
            "transformers_ttft": transformers_ttft(prefixes, rounds, dev), "fork_memory": fork_memory(device=device)}


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--rounds", type=positive_int, default=2)
        add_ttft_prefixes(parser)

    bench_main(__doc__, options, lambda a: run(a.ttft, a.rounds, a.device))


if __name__ == "__main__":
    main()
