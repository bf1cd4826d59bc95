"""``make bench`` = ``python -m flashrt_ros.bench [--out bench]``: every benchmark, one run.

Runs the runtime, capsule, prompt-reuse, ROS service, replay, speculative-decoding and fleet-tier benchmarks,
the policy's training step, then the released 0.8B shape's (random weights), in turn,
prints every target of the earlier issues as PASS or MISS, and writes
``<out>/results.json`` and one PNG per section. Each figure is a ratio
measured within this run; absolute times are labelled with the machine.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import capsules, charts, fleet, released, replay, reuse, runtime, speculative, training
from .common import code_version, machine, verdict_line


def _ros_services(calls: int):
    try:
        import rclpy  # noqa: F401
    except ImportError as exc:  # the ROS-free install (pip install -e .) has no rclpy
        print(f"== ROS service overhead: skipped ({exc})")
        return None
    from . import ros_services

    return ros_services.run(calls)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashrt_ros.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench", help="folder for results.json and the PNGs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and shorter prefixes (a smoke run)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prefixes = (512, 1024) if args.quick else (2048, 4096, 8192, 16384)
    rounds = 1 if args.quick else 5
    sections = [
        # Seven rounds (a few seconds each): three medians are thin; two runs of the same code
        # read a prefill ratio of 1.22 and 1.35 with three.
        ("runtime", lambda: runtime.run(args.device, rounds=2 if args.quick else 7)),
        ("capsules", lambda: capsules.run(args.device, rounds, prefixes)),
        ("reuse", lambda: reuse.run(prefixes, 1 if args.quick else 2, args.device)),
        ("ros_services", lambda: _ros_services(50 if args.quick else 400)),
        ("replay", lambda: replay.run(60.0 if args.quick else 600.0)),
        ("speculative", lambda: speculative.run(args.device, 32 if args.quick else 128, 1 if args.quick else 5)),
        ("fleet", lambda: fleet.run(None, (512, 1024) if args.quick else (2048, 8192, 16384), rounds)),
        ("training", lambda: training.run(2 if args.quick else 5, 5 if args.quick else 20)),
        ("released", lambda: released.run("Qwen3.5-0.8B", *((64, 4, 1, (512,)) if args.quick
                                                            else (512, 16, 3, (2048,))))),
    ]
    results: dict = {"machine": machine(), "device": args.device, "code": code_version(), "started": time.time(),
                     "seconds": {}}
    progress = tqdm(sections, desc="make bench", unit="section", position=0)
    for name, fn in progress:
        progress.set_description(f"make bench: {name}")
        start = time.monotonic()
        print(f"\n== {name}")
        results[name] = fn()
        results["seconds"][name] = time.monotonic() - start
    progress.close()

    where = results["machine"] + ("" if args.device == "cpu" else f" ({args.device})")
    pictures = [charts.runtime(results["runtime"], out / "runtime.png", where),
                charts.copies(results["capsules"]["copies"], out / "copies.png", where),
                charts.ttft(results["capsules"]["ttft"], results["reuse"]["transformers_ttft"], out / "ttft.png",
                            where),
                charts.fork_memory(results["reuse"]["fork_memory"], out / "fork_memory.png", where)]
    if results["ros_services"]:
        pictures.append(charts.services(results["ros_services"], out / "services.png", where))
    checks = [c for key in ("runtime", "capsules", "ros_services", "replay", "speculative", "fleet", "released")
              if results.get(key)
              for c in results[key]["checks"]]
    results["checks"] = checks
    (out / "results.json").write_text(json.dumps(results, indent=2))

    print(f"\n== summary ({where}; code {results['code']})")
    for c in checks:
        print(verdict_line(c))
    print(f"  {sum(c['pass'] for c in checks)} of {len(checks)} targets met; "
          f"{sum(results['seconds'].values()) / 60:.1f} minutes")
    for p in [out / "results.json", *pictures]:
        print(f"  wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
