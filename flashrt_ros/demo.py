"""``make demo``: the embedded default model prefills a prompt and generates.

Prints time to first token (prefill + the first decode step) and decode
tokens/s. The weights are seeded, not trained, so the text is noise; the
numbers and the state boundaries are what this shows.
"""
from __future__ import annotations

import argparse
import time

import torch

from .runtime import Engine, ModelConfig
from .runtime.tokenizer import ByteTokenizer

PROMPT = ("Task: pick the red cube from the left bin, place it on the tray, "
          "then return to the home pose. Report any collision. ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200, help="tokens to generate")
    parser.add_argument("--repeat", type=int, default=8, help="prompt repetitions (a longer task context)")
    args = parser.parse_args()

    tok = ByteTokenizer()
    start = time.perf_counter()
    engine = Engine.from_config(ModelConfig.tiny(), seed=0, max_seq_len=4096)
    built = time.perf_counter() - start
    ids = tok.encode(PROMPT * args.repeat)

    t0 = time.perf_counter()
    engine.prefill(ids)
    first = engine.generate(1)
    ttft = time.perf_counter() - t0
    t1 = time.perf_counter()
    rest = engine.generate(args.tokens - 1)
    decode = time.perf_counter() - t1

    print(f"flashrt_ros demo: embedded default model (ModelConfig.tiny(), seed 0) on {engine.device}, "
          f"torch {torch.__version__}")
    print(f"  engine built in {built * 1e3:.0f} ms; arena {engine.arena.nbytes / 2**20:.1f} MiB in "
          f"{len(engine.region_table)} regions; model {engine.model_fingerprint[:12]}, "
          f"layout {engine.layout_fingerprint[:12]}")
    print(f"  prompt {len(ids)} tokens -> TTFT {ttft * 1e3:.1f} ms")
    print(f"  decode {len(rest)} tokens in {decode * 1e3:.0f} ms -> {len(rest) / decode:.0f} tokens/s")
    print(f"  position {engine.position}, state digest {engine.state_digest()[:16]}")
    print(f"  text (seeded weights, so noise): {tok.decode(first + rest)[:80]!r}")


if __name__ == "__main__":
    main()
