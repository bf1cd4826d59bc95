"""Decode and prefill of this engine vs transformers on the same weights, and the bandwidth limit.

    python -m flashrt_ros.bench.runtime [--device cpu] [--prompt 512] [--tokens 32] [--rounds 5]

Both run in this one process, on the same ``ModelConfig.bench()`` checkpoint
(written to a temp folder and loaded by each), interleaved round by round.
transformers' decode is its cached forward called one token at a time (no
``generate`` overhead). Its weights are copied off the file's memory map into
the process's own memory, where this engine's are too. The limit is
the weight bytes one decode step reads divided by the memcpy bandwidth of one
plain copy of 256 MiB, bytes moved (read plus written), measured in the same
rounds.

The prefill ceiling bounds the prefill speed-up on this machine with the products
as they are: the measured speed-up divided by the share of this engine's prefill
spent in matrix products (the profiler's own time of mm, bmm, addmm, baddbmm and
oneDNN's linear over the wall time of the same prefill), i.e. transformers' time
over our products alone. Only faster products can go past it (both run prefill's
projections on torch's product). The profiler's own bookkeeping lengthens the wall time it divides by, so the
printed ceiling is a little high: a bound still, if a loose one.

The decode floor is the same question for decode/limit (CPU only): the step's
weights read once by a plain ``sum`` (the fastest torch streams them here; a
product reads the same bytes and does more with them) plus the step with every
weight product replaced by a ready-made output of its shape, i.e. everything
the eager step does besides reading weights. Their sum over the limit is the
ratio an eager step would reach with perfect products. An estimate, not a proof:
a kernel could stream faster than torch's ``sum``.

On a CPU, each kernel of the CPU backend is also timed against the torch op it replaces, in
the same rounds: the row kernel against ``x @ w`` over every projection of a decode step (one
row, and the rows of a verify), the delta kernel against the torch layer (``delta_rule``) over
every linear layer, for one token and for a prompt chunk. A kernel earns its place with a
clear ratio here (or, for the delta rule, by doing what torch has no op for).
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Callable

import torch

from ..runtime import Engine, ModelConfig
from ..runtime.projection import Projection
from ..runtime.weights import save_checkpoint, seeded_weights
from .common import bench_main, copy_bandwidth, interleaved, machine, positive_int, timed, verdict


def _hf_model(path: str, device: torch.device):
    import transformers
    from transformers import Qwen3_5ForCausalLM

    transformers.logging.set_verbosity_error()
    model = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    with torch.no_grad():
        for param in model.parameters():   # off the file's memory map, like ours
            param.data = param.data.clone()
    return model


def _hf_kernels() -> str:
    """Which gated-delta and conv kernels transformers runs: on a GPU it takes fla's and
    causal_conv1d's when they are installed, else its pure-torch fallback, which is slower
    and would flatter the ratios against it."""
    from importlib.util import find_spec

    have = [name for name in ("fla", "causal_conv1d") if find_spec(name) is not None]
    missing = [name for name in ("fla", "causal_conv1d") if name not in have]
    if not missing:
        return "fla and causal_conv1d kernels"
    return (f"its pure-torch fallback where {' and '.join(missing)} is not installed "
            f"(the ratios against transformers are then against its slower path)")


PRODUCTS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


def product_share(fn: Callable[[], object]) -> float:
    """The share of ``fn``'s wall time spent inside matrix-product kernels (profiler self time)."""
    from torch.profiler import ProfilerActivity, profile

    # Kineto reads this at the profiler's first start; its default level prints a line at
    # every start and stop into the benchmark's report.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        fn()
        wall = time.perf_counter() - start
    return sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in PRODUCTS) / 1e6 / wall


class DecodeFloor:
    """The two parts of the decode floor (see the module docstring), each a timing function
    that returns seconds per token, so that they run in the same interleaved rounds."""

    def __init__(self, engine: Engine, ids: torch.Tensor, tokens: int) -> None:
        self.engine, self.ids, self.tokens = engine, ids, tokens
        self.weights = [p.w for p in engine.model.projections()]
        self.outputs: dict[int, torch.Tensor] = {}

    def read(self) -> float:
        return timed(lambda: [w.sum() for w in self.weights], self.engine.device)

    def rest(self) -> float:
        def ready_made(proj: Projection, x: torch.Tensor) -> torch.Tensor:
            out = self.outputs.get(id(proj))
            if out is None:
                out = self.outputs[id(proj)] = torch.zeros(1, proj.w.shape[1], dtype=x.dtype, device=x.device)
            return out

        engine = self.engine
        engine.reset()
        engine.prefill(self.ids)
        real = Projection.__call__
        Projection.__call__ = ready_made   # only this benchmark's one engine steps while it is in place
        try:
            return timed(lambda: engine.generate(self.tokens), engine.device) / self.tokens
        finally:
            Projection.__call__ = real


class KernelRatios:
    """Timing functions for each CPU-backend kernel and its torch op (see the module docstring),
    on random inputs of the engine's own shapes; they change the arena's state (reset after)."""

    VERIFY_ROWS = 4

    def __init__(self, engine: Engine, prompt: int) -> None:
        gen = torch.Generator().manual_seed(3)
        self.model = engine.model
        self.projections = self.model.projections()
        self.rows = {m: [torch.randn(m, p.w.shape[0], generator=gen) for p in self.projections]
                     for m in (1, self.VERIFY_ROWS)}
        self.linear = [b for b in self.model.blocks if b.delta is not None]
        self.mixer_rows = {n: [torch.randn(n, b.in_proj.w.shape[1], generator=gen) for b in self.linear]
                           for n in (1, prompt)}

    def contenders(self) -> dict[str, Callable[[], float]]:
        cpu = torch.device("cpu")
        out: dict[str, Callable[[], float]] = {}
        for m, xs in self.rows.items():
            out[f"rows{m}_kernel"] = lambda xs=xs: timed(lambda: [p(x) for p, x in zip(self.projections, xs)], cpu)
            out[f"rows{m}_torch"] = lambda xs=xs: timed(lambda: [x @ p.w for p, x in zip(self.projections, xs)], cpu)
        for n, rows in self.mixer_rows.items():
            out[f"delta{n}_kernel"] = lambda rows=rows: timed(
                lambda: [b.delta(r) for b, r in zip(self.linear, rows)], cpu)
            out[f"delta{n}_torch"] = lambda rows=rows: timed(
                lambda: [self.model.delta_rule(r, b) for b, r in zip(self.linear, rows)], cpu)
        return out

    def batch_invariant(self) -> dict[str, bool]:
        """Whether a few-row product gives each row the bytes it has alone, for the kernel and for
        torch's product, over every projection: what verify rows need to match decode steps."""
        out = {}
        for name, product in (("kernel", lambda p, x: p(x)), ("torch", lambda p, x: x @ p.w)):
            out[name] = all(torch.equal(product(p, x), torch.cat([product(p, x[i:i + 1]) for i in range(len(x))]))
                            for p, x in zip(self.projections, self.rows[self.VERIFY_ROWS]))
        return out

    def report(self, t: dict[str, float]) -> dict[str, float]:
        ratios = {}
        names = {"rows1": "row kernel, one row (decode)", f"rows{self.VERIFY_ROWS}":
                 f"row kernel, {self.VERIFY_ROWS} rows (verify)", "delta1": "delta kernel, one token",
                 f"delta{max(self.mixer_rows)}": f"delta kernel, {max(self.mixer_rows)} tokens"}
        for key, label in names.items():
            ratios[key] = t[f"{key}_torch"] / t[f"{key}_kernel"]
            print(f"  cpu backend        {label}: torch {t[f'{key}_torch'] * 1e3:8.3f} ms, kernel "
                  f"{t[f'{key}_kernel'] * 1e3:8.3f} ms: x{ratios[key]:.2f}")
        same = self.batch_invariant()
        print(f"  cpu backend        rows of a {self.VERIFY_ROWS}-row product bit-identical to single-row products: "
              f"kernel {same['kernel']}, torch {same['torch']} (the row kernel's reason to exist: verify rows "
              f"must match decode steps)")
        ratios.update({f"batch_invariant_{k}": float(v) for k, v in same.items()})
        return ratios


def run(device: str = "cpu", prompt: int = 512, tokens: int = 32, rounds: int = 5, cfg: ModelConfig | None = None,
        label: str = "ModelConfig.bench()") -> dict:
    """``cfg`` (default ``ModelConfig.bench()``, named ``label`` in the output): the model both run."""
    dev = torch.device(device)
    cfg = cfg or ModelConfig.bench()
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(tmp, cfg, seeded_weights(cfg, seed=0))
        engine = Engine.from_pretrained(tmp, device=dev, max_seq_len=prompt + tokens * (rounds + 2) + 8)
        hf = _hf_model(tmp, dev)
    ids = torch.randint(0, cfg.vocab_size, (prompt,), generator=torch.Generator().manual_seed(0))
    hf_ids = ids[None].to(dev)

    def ours_prefill() -> float:
        engine.reset()
        return timed(lambda: engine.prefill(ids), dev)

    def hf_prefill() -> float:
        # logits_to_keep=1: the last position's logits only, as generate() asks for and as
        # engine.prefill returns (all 512 rows of logits took transformers 1.58x as long here).
        with torch.inference_mode():
            return timed(lambda: hf(hf_ids, use_cache=True, logits_to_keep=1), dev)

    def prefill_share() -> float:
        engine.reset()
        return product_share(lambda: engine.prefill(ids))

    def ours_decode() -> float:
        engine.reset()
        engine.prefill(ids)
        return timed(lambda: engine.generate(tokens), dev) / tokens

    def hf_decode() -> float:
        with torch.inference_mode():
            out = hf(hf_ids, use_cache=True, logits_to_keep=1)
            cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)

            def loop() -> None:
                nonlocal cache, nxt
                for _ in range(tokens):
                    out = hf(nxt, cache=cache, use_cache=True)
                    cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
            return timed(loop, dev) / tokens

    contenders = {"ours_prefill": ours_prefill, "hf_prefill": hf_prefill, "ours_decode": ours_decode,
                  "hf_decode": hf_decode, "copy": lambda: 1.0 / copy_bandwidth(256 * 2**20, dev, rounds=3)}
    kernels = None
    if dev.type == "cpu":   # a captured CUDA graph replays its own kernels, whatever Projection does now
        floor_parts = DecodeFloor(engine, ids, tokens)
        contenders.update(floor_read=floor_parts.read, floor_rest=floor_parts.rest)
        if engine.cpu_kernels:
            kernels = KernelRatios(engine, prompt)
            contenders.update(kernels.contenders())
    for name, fn in contenders.items():  # warm-up: kernels, allocator
        if name != "copy":
            fn()
    with torch.inference_mode():
        t = interleaved(contenders, rounds)
    bandwidth = 1.0 / t["copy"]
    speedup = t["hf_prefill"] / t["ours_prefill"]
    # The median of three profiled prefills; both shares come from one run each, so noise between runs cancels.
    share = sorted(prefill_share() for _ in range(3))[1] if dev.type == "cpu" else None
    weight_bytes = engine.model.weight_bytes_per_token()
    limit = weight_bytes / bandwidth

    print(f"runtime benchmark on {machine()}")
    if dev.type == "cuda":
        print(f"  transformers' linear attention: {_hf_kernels()}")
    print(f"  model: {label}, fp32, prompt {prompt} tokens, {tokens} decode tokens, {rounds} rounds (medians)")
    print(f"  prefill tokens/s   ours {prompt / t['ours_prefill']:9.1f}   transformers {prompt / t['hf_prefill']:9.1f}")
    if share:
        print(f"  prefill ceiling    x{speedup / share:.2f} over transformers: {share:.0%} of this engine's prefill "
              f"is matrix products; everything else free")
    print(f"  decode ms/token    ours {t['ours_decode'] * 1e3:9.2f}   transformers {t['hf_decode'] * 1e3:9.2f}")
    print(f"  limit ms/token     {limit * 1e3:.2f}  ({weight_bytes / 1e6:.1f} MB of weights per step "
          f"/ {bandwidth / 1e9:.1f} GB/s memcpy bandwidth, bytes read plus written)")
    floor = None
    if "floor_read" in t:
        floor = (t["floor_read"] + t["floor_rest"]) / limit
        print(f"  decode floor       x{floor:.2f} of the limit: the weights read by a plain sum "
              f"({t['floor_read'] * 1e3:.2f} ms) plus the step without its weight products "
              f"({t['floor_rest'] * 1e3:.2f} ms)")
    ratios = kernels.report(t) if kernels is not None else {}
    results = {
        "machine": machine(), "device": str(dev), "cpu_kernel_ratios": ratios,
        "prefill_tokens_per_s": {"ours": prompt / t["ours_prefill"], "transformers": prompt / t["hf_prefill"]},
        "decode_ms_per_token": {"ours": t["ours_decode"] * 1e3, "transformers": t["hf_decode"] * 1e3},
        "limit_ms_per_token": limit * 1e3,
        "prefill_ceiling": speedup / share if share else None,
        "decode_floor": floor,
        "checks": [
            verdict("decode speed-up over transformers", t["hf_decode"] / t["ours_decode"], 2.0, True),
            verdict("decode time / bandwidth limit", t["ours_decode"] / limit, 1.5, False),
            verdict("prefill speed-up over transformers", speedup, 1.3, True),
        ],
    }
    engine.close()
    return results


def main() -> None:
    def options(parser) -> None:
        parser.add_argument("--prompt", type=positive_int, default=512)
        parser.add_argument("--tokens", type=positive_int, default=32)
        parser.add_argument("--rounds", type=positive_int, default=5)

    bench_main(__doc__, options, lambda a: run(a.device, a.prompt, a.tokens, a.rounds))


if __name__ == "__main__":
    main()
