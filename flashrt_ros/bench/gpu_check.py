"""One prepared GPU check: CUDA-graph decode and device-tier capsules on the same buffers.

    python -m flashrt_ros.bench.gpu_check

Checks that graphed decode gives the tokens eager decode gives, that a
restore keeps the captured graph valid (no recapture, identical tokens), and
reports the restore time of a 16k-token ``ModelConfig.bench()`` state with
CUDA events (target < 0.5 ms), and that a host-tier capsule (copied to pinned
memory without blocking) hashes and restores the bytes it was taken from.
Exits non-zero on a failed check.
"""
from __future__ import annotations

import sys

import torch

from ..runtime import Engine, ModelConfig
from .common import CacheFlush


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    ok = True
    cfg = ModelConfig.bench()
    prompt = torch.randint(0, cfg.vocab_size, (16384,), generator=torch.Generator().manual_seed(0))
    graphed = Engine.from_config(cfg, device="cuda", max_seq_len=16384 + 256)
    # The same code uncaptured: fixed shapes (every row, masked), as the graph runs it. Live-row
    # decode sums over other lengths, so its last bits may differ; the graph's must not.
    eager = Engine.from_config(cfg, device="cuda", max_seq_len=16384 + 256, cuda_graphs=False, static_shapes=True)
    for engine in (graphed, eager):
        engine.prefill(prompt)
    same = graphed.generate(32) == eager.generate(32)
    exact = graphed.state_digest() == eager.state_digest()
    print(f"graphed decode == the same code uncaptured (32 tokens at 16k): tokens {same}, state bytes {exact}")
    ok &= same and exact

    capsule = graphed.snapshot(pin=True)
    first = graphed.generate(32)
    captures = graphed._token_step.captures
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    flush = CacheFlush(graphed.device)

    def timed_restore(fresh: bool) -> float:
        if fresh:
            graphed.reset()  # nothing shared: the whole state is copied
        else:
            graphed.generate(8)  # built on the capsule: the return copies the fixed state only
        flush()   # nothing the restore reads or writes left in the L2 cache
        start.record()
        graphed.restore(capsule)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    full = sorted(timed_restore(True) for _ in range(20))
    back = sorted(timed_restore(False) for _ in range(20))  # the state descends from the capsule
    again = graphed.generate(32)
    nbytes = sum(e - s for s, e in graphed.capsules.layout.ranges(capsule.position))
    print(f"restore of a 16k-token state ({nbytes / 2**20:.1f} MiB): median {full[len(full) // 2]:.3f} ms "
          f"(target < 0.5 ms); a return to it from a descendant state: {back[len(back) // 2]:.3f} ms")
    print(f"tokens after restore identical: {first == again}; graph captures before/after: "
          f"{captures}/{graphed._token_step.captures}")
    ok &= first == again and captures == graphed._token_step.captures == 1
    ok &= full[len(full) // 2] < 0.5

    # A host-tier snapshot copies to pinned memory without blocking; its digest, computed on the
    # CPU by another thread, must see the copied bytes, not what the pinned buffer held before.
    live = graphed.state_digest()
    host = graphed.snapshot(tier="host")
    graphed.generate(8)
    hashed = graphed.capsules.get(host.id).digest == live
    graphed.restore(host)
    print(f"host-tier capsule digest == live digest at the snapshot: {hashed}; "
          f"restored from host exactly: {graphed.state_digest() == live}")
    ok &= hashed and graphed.state_digest() == live
    graphed.close()
    eager.close()
    print("gpu_check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
