"""On paper: the state and capsule sizes of the released models in bf16, and what a Jetson Thor's
128 GB of unified memory leaves for capsules beside the weights (docs/thor.md).

    python -m flashrt_ros.bench.sizes [--max-seq-len 32768] [--rollback-depth 16] [--max-draft 4]

Computed from the arena's own region table (``state_specs``), not measured. The engine holds,
beside the weights: the arena (the fixed block and max_seq_len rows), the rollback ring
(rollback_depth + 2 copies of the fixed block) and the verify's images (max_draft + 1 copies).
"""
from __future__ import annotations

import argparse

import torch

from ..runtime.released import RELEASED, parameters, state_bytes, state_config

GiB, MiB, KiB = 1 << 30, 1 << 20, 1 << 10
THOR_BYTES = 128 * 10**9
RESERVED = 16 * GiB   # the OS, ROS 2, the camera and perception stack: a stated assumption, not a measurement


def rows(max_seq_len: int, rollback_depth: int, max_draft: int) -> list[dict]:
    out = []
    for name, text in RELEASED.items():
        fixed, per_token = state_bytes(state_config(text), torch.bfloat16)
        weights = 2 * parameters(text)
        engine = fixed * (1 + rollback_depth + 2 + max_draft + 1) + max_seq_len * per_token
        out.append({"model": name, "weights": weights, "fixed": fixed, "per_token": per_token,
                    "capsule_4k": fixed + 4096 * per_token, "capsule_16k": fixed + 16384 * per_token,
                    "engine": engine, "left": THOR_BYTES - RESERVED - weights - engine})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seq-len", type=int, default=32768)
    parser.add_argument("--rollback-depth", type=int, default=16)
    parser.add_argument("--max-draft", type=int, default=4)
    args = parser.parse_args(argv)
    print(f"bf16; engine = arena at max_seq_len {args.max_seq_len} + ring ({args.rollback_depth} + 2) + verify "
          f"images ({args.max_draft} + 1); left = 128 GB - {RESERVED // GiB} GiB reserved - weights - engine")
    print("| model | weights GiB | fixed MiB | per token KiB | capsule 4k MiB | capsule 16k MiB | engine GiB "
          "| left for capsules GiB | 16k capsules in 8 GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows(args.max_seq_len, args.rollback_depth, args.max_draft):
        print(f"| {r['model']} | {r['weights'] / GiB:.1f} | {r['fixed'] / MiB:.1f} | {r['per_token'] / KiB:.1f} "
              f"| {r['capsule_4k'] / MiB:.0f} | {r['capsule_16k'] / MiB:.0f} | {r['engine'] / GiB:.2f} "
              f"| {r['left'] / GiB:.0f} | {8 * GiB // r['capsule_16k']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
