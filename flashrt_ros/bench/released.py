"""A released model's shape (random weights), loaded as a checkpoint folder is, measured side by
side in one run.

    python -m flashrt_ros.bench.released [--model Qwen3.5-0.8B] [--prompt 512] [--tokens 16]
                                         [--rounds 3] [--ttft 2048] [--sections 1,2,3,4]
                                         [--folder DIR]

The shape is ``runtime.released.RELEASED[model]`` (its published config.json); the weights are
seeded, so nothing is downloaded. ``--folder`` names a checkpoint folder instead (a release
downloaded): step 1 loads it as it is, and its config is every step's shape. In order, each
step freeing what it made:
1. load: ``Engine.from_pretrained`` of a checkpoint folder (bf16 when seeded; a CPU computes in
   fp32, a GPU keeps bf16), each in a fresh process as a node loads, against reading its files
   once, interleaved: both from the disk (the files' pages dropped from the page cache before
   each: the speed of the disk, target <= 2; in a VM a file read back soon after it was
   written may come from the host's memory, not its disk) and both from the page cache (what
   the load costs beyond reading). On a GPU (``gpu_check`` runs this step on its device), the
   target is the weights' load, and the load with the decode and verify graphs captured, as a
   node loads, is timed beside it. On a CPU, side by side with these: the same load with
   torch's copies in place of the package's transposing cast; with the weights on transparent
   huge pages, and decoding on them; and filling fresh memory of the built weights' size (what
   a load spends beyond reading on this machine, however its bytes are written). The peak
   resident memory once loaded;
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
import contextlib
import gc
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from ..runtime import Engine, ModelConfig
from ..runtime.backends.cpu import transpose_cast
from ..runtime.models import cast
from ..runtime.released import RELEASED
from ..runtime.weights import expected_shapes, kept_bytes, save_checkpoint, seeded_weights, weight_files
from . import capsules, runtime
from .common import bench_main, interleaved, machine, positive_int, verdict

PARITY_PROMPT = 16
PARITY_TOKENS = 12
PAGE_DECODE_TOKENS = 16   # timed after as many again: a new engine's first steps run slow
_TIMED = "flashrt-timed"   # marks the line a child reports its seconds on
_CHILD_TIMEOUT_S = 1800   # a child that hangs fails the bench rather than stalling it
NO_DISK = ("no figures from the disk here (the folder is on a file system kept in memory, or the "
           "files' pages cannot be dropped)")


def config_of(model: str) -> ModelConfig:
    if model not in RELEASED:
        raise SystemExit(f"unknown model {model!r}: one of {', '.join(RELEASED)}")
    return ModelConfig.from_hf_config(RELEASED[model])


def peak_rss_gib() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def in_memory(path: Path) -> bool:
    """Whether ``path`` lies on a file system kept in memory (tmpfs, ramfs), which has no disk
    to read from: the longest mount point of /proc/self/mounts that holds it says."""
    try:
        mounts = [line.split()[1:3] for line in Path("/proc/self/mounts").read_text().splitlines()]
    except OSError:
        return False
    resolved = str(path.resolve())
    held = [(point, kind) for point, kind in mounts
            if resolved == point or resolved.startswith(point.rstrip("/") + "/")]
    return bool(held) and max(held, key=lambda m: len(m[0]))[1] in ("tmpfs", "ramfs")


def evict(files: list[Path]) -> bool:
    """Drop the files' pages from the page cache (``POSIX_FADV_DONTNEED``, which needs no root
    and drops clean pages only: ``load_ratio`` syncs the files first), so that the next read
    comes from the disk. False where the call is missing or a file has no disk."""
    if not hasattr(os, "posix_fadvise") or not files or any(in_memory(f) for f in files):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_by_load(folder: Path) -> list[Path]:
    """The files of a checkpoint folder that a load reads: its configs, its shard index and its
    weights (a released folder's tokenizer files are the node's, read once it serves)."""
    configs = [folder / name for name in ("config.json", "generation_config.json", "model.safetensors.index.json")]
    return [f for f in configs if f.is_file()] + weight_files(folder)


def load_ratio(cfg: ModelConfig, rounds: int, device: str = "cpu", folder: str | Path | None = None) -> dict:
    """Loading a checkpoint folder against reading its files once, from the disk and from the
    page cache: ``folder`` as it is (``cfg`` its config), else seeded weights of ``cfg`` saved in
    bf16 to a temporary folder. On a CPU the engine computes in fp32; on another ``device`` in
    bf16, and a load ends once the device has its weights."""
    dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16

    with contextlib.ExitStack() as stack:
        if folder is None:
            # In TMPDIR: on tmpfs only the page-cache figures are taken.
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            weights = {k: v.to(torch.bfloat16) for k, v in seeded_weights(cfg, seed=0).items()}
            save_checkpoint(folder, cfg, weights)
            del weights
            what = "bf16 folder"
        else:
            folder, what = str(folder), f"folder {folder}"
        files = read_by_load(Path(folder))
        for f in files:   # written back, so that dropping the pages makes the next read the disk's
            with open(f, "rb") as stream, contextlib.suppress(OSError):   # a read-only mount has none to write
                os.fsync(stream.fileno())
        nbytes = sum(f.stat().st_size for f in files)
        kept = kept_bytes(folder, cfg)

        def loaded() -> Engine:
            engine = Engine.from_pretrained(folder, device=device, dtype=dtype, max_seq_len=64)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            return engine

        buffer = memoryview(bytearray(16 << 20))

        def read(cold: bool) -> float:
            if cold:
                evict(files)
            # Into one buffer, as `cat` reads: a fresh object per read() would time the
            # allocator's page faults on it, not the reading.
            start = time.perf_counter()
            for f in files:
                with open(f, "rb", buffering=0) as stream:
                    while stream.readinto(buffer):
                        pass
            return time.perf_counter() - start

        def load(cold: bool, kernel: bool = True, huge: bool = False, graphs: bool = False) -> float:
            if cold:
                evict(files)
            return in_fresh_process({"load": folder, "device": device, "dtype": str(dtype), "kernel": kernel,
                                     "huge": huge, "cuda_graphs": graphs})

        def decode(huge: bool) -> float:
            """ms per greedy token of an engine whose weights are on huge or ordinary pages."""
            with cast.huge_pages() if huge else contextlib.nullcontext():
                engine = loaded()
            try:
                engine.prefill(torch.arange(8) % cfg.vocab_size)
                engine.generate(PAGE_DECODE_TOKENS)
                start = time.perf_counter()
                engine.generate(PAGE_DECODE_TOKENS)
                return (time.perf_counter() - start) / PAGE_DECODE_TOKENS * 1e3
            finally:
                engine.close()

        read(False)
        engine = loaded()
        peak = peak_rss_gib()
        weight_bytes = sum(math.prod(shape) for shape in expected_shapes(cfg).values()) \
            * torch.empty((), dtype=dtype).element_size()   # the built weights: a tied head is the embedding
        engine.close()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()   # the children's loads get the device's memory, not this cache
        fns: dict[str, Callable[[], float]] = {"read": lambda: read(False), "load": lambda: load(False)}
        if dtype == torch.float32 and transpose_cast.serves(torch.empty(0, dtype=torch.bfloat16), torch.empty(0)):
            fns["torch_load"] = lambda: load(False, kernel=False)
        if torch.device(device).type == "cuda":
            fns["graphs_load"] = lambda: load(False, graphs=True)
        if torch.device(device).type == "cpu":
            fns |= {"fill": lambda: in_fresh_process({"fill": weight_bytes}),
                    "huge_load": lambda: load(False, huge=True),
                    "decode": lambda: decode(False), "huge_decode": lambda: decode(True)}
        if evict(files):
            fns |= {"cold_read": lambda: read(True), "cold_load": lambda: load(True)}
        t = interleaved(fns, rounds)
    if kept < 0.99 * nbytes:   # a multimodal release's vision tower: read by the baseline, skipped by a load
        print(f"  of the folder's {nbytes / 2**30:.2f} GiB, the tensors a load keeps are {kept / 2**30:.2f} GiB: "
              f"reading its files once reads all of them")
    print(f"  load: {nbytes / 2**30:.2f} GiB {what} onto {device}, computing in "
          f"{str(dtype).removeprefix('torch.')}, each load in a fresh process; peak RSS {peak:.2f} GiB")
    if "cold_read" in t:
        print(f"  from the disk: read in {t['cold_read']:.2f} s, loaded in {t['cold_load']:.2f} s "
              f"({t['cold_load'] / t['cold_read']:.2f}x)")
    print(f"  from the page cache: read in {t['read']:.3f} s, loaded in {t['load']:.2f} s "
          f"({t['load'] / t['read']:.2f}x)")
    if "fill" in t:
        reading, loading = t.get("cold_read", t["read"]), t.get("cold_load", t["load"])
        print(f"  fresh memory: filling {weight_bytes / 2**30:.2f} GiB of new pages (the built weights' size) takes "
              f"{t['fill']:.2f} s here; with the reading {reading + t['fill']:.2f} s, and the load "
              f"{loading / (reading + t['fill']):.2f}x of that")
        print(f"  weights on torch.empty's pages against transparent huge pages asked for ({thp_settings()}): "
              f"loaded in {t['load']:.2f} against "
              f"{t['huge_load']:.2f} s ({t['huge_load'] / t['load']:.2f}x), decoding at {t['decode']:.1f} against "
              f"{t['huge_decode']:.1f} ms/token ({t['decode'] / t['huge_decode']:.2f}x), from the page cache")
    if "graphs_load" in t:
        print(f"  with the decode and verify graphs captured, as a node loads: {t['graphs_load']:.2f} s against "
              f"{t['load']:.2f} s for the weights alone, from the page cache")
    if "torch_load" in t:
        print(f"  the weights transposed and cast by the package's kernel: loaded in {t['load']:.2f} s, by torch's "
              f"copies in {t['torch_load']:.2f} s ({t['torch_load'] / t['load']:.2f}x), from the page cache")
    return {"file_bytes": nbytes, "kept_bytes": kept, "read_s": t["read"], "load_s": t["load"],
            "cold_read_s": t.get("cold_read"), "cold_load_s": t.get("cold_load"), "torch_load_s": t.get("torch_load"),
            "dtype": str(dtype),
            "peak_rss_gib": peak, "weight_bytes": weight_bytes, "fill_s": t.get("fill"),
            "huge_load_s": t.get("huge_load"), "decode_ms": t.get("decode"), "huge_decode_ms": t.get("huge_decode"),
            "graphs_load_s": t.get("graphs_load")}


def thp_settings() -> str:
    """The system's transparent huge page settings: with ``enabled`` at ``always`` torch.empty
    gets huge pages too; with ``defrag`` at ``madvise`` or ``always`` an advised fault may wait
    while the kernel compacts memory."""
    chosen = []
    for knob in ("enabled", "defrag"):
        try:
            text = Path(f"/sys/kernel/mm/transparent_hugepage/{knob}").read_text()
        except OSError:
            return "no transparent huge pages here"
        chosen.append(f"{knob} {text[text.find('[') + 1:text.find(']')] if '[' in text else text.strip()}")
    return ", ".join(chosen)


def in_fresh_process(job: dict) -> float:
    """Seconds that ``timed_once(job)`` measures in a new interpreter. A node loads its model once,
    as it starts; a second load in one process reuses the memory the first one freed, which is
    cheaper than fresh memory by a factor that varies from machine to machine (a VM that hands
    freed memory back to its host charges for every fresh page, more for a huge one)."""
    child = ("import json, sys; from flashrt_ros.bench.released import timed_once; "
             f"print({_TIMED!r}, timed_once(json.loads(sys.argv[1])))")
    package_root = str(Path(__file__).parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (package_root, os.environ.get("PYTHONPATH")))))
    done = subprocess.run([sys.executable, "-c", child, json.dumps(job)], capture_output=True, text=True, env=env,
                          timeout=_CHILD_TIMEOUT_S)
    said = [line.split()[1] for line in done.stdout.splitlines() if line.startswith(_TIMED + " ")]
    if done.returncode or not said:
        raise RuntimeError(f"the timed {next(iter(job))} failed in its process (exit {done.returncode}): "
                           f"{(done.stderr.strip() or done.stdout.strip())[-2000:]}")
    return float(said[-1])


def timed_once(job: dict) -> float:
    """``{"load": folder, "device", "dtype", "kernel", "huge", "cuda_graphs"}``: seconds until
    the engine has its weights (with torch's copies in place of the transposing cast unless
    ``kernel``; on huge pages if ``huge``; on a GPU with its decode and verify graphs captured
    too if ``cuda_graphs``). ``{"fill": nbytes}``: seconds to allocate and write that much new
    memory in 256 MiB pieces, all held to the end as a load holds its weights: what a load pays
    for memory however its bytes are written. A device's context and its BLAS handle are made
    before the clock starts: the comparison is with reading files, which needs neither, and a
    process makes them once whatever it loads."""
    if "fill" in job:
        start = time.perf_counter()
        held = [torch.empty(min(256 << 20, job["fill"] - at), dtype=torch.uint8).fill_(1)
                for at in range(0, job["fill"], 256 << 20)]
        return time.perf_counter() - start   # ``held``, all of it, lives until the clock is read
    dtype = getattr(torch, job["dtype"].removeprefix("torch."))
    with contextlib.ExitStack() as switches:
        if not job["kernel"]:
            switches.enter_context(transpose_cast.disabled())
        if job["huge"]:
            switches.enter_context(cast.huge_pages())
        if torch.device(job["device"]).type == "cuda":
            warm = torch.ones(8, 8, device=job["device"], dtype=dtype)
            warm @ warm
            torch.cuda.synchronize(job["device"])
        start = time.perf_counter()
        with Engine.from_pretrained(job["load"], device=job["device"], dtype=dtype, max_seq_len=64,
                                    cuda_graphs=job.get("cuda_graphs", False)) as engine:
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            return time.perf_counter() - start


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


SECTIONS = (1, 2, 3, 4)


@torch.no_grad()
def run(model: str = "Qwen3.5-0.8B", prompt: int = 512, tokens: int = 16, rounds: int = 3,
        ttft: tuple[int, ...] = (2048,), cfg: ModelConfig | None = None,
        sections: tuple[int, ...] = SECTIONS, folder: str | Path | None = None) -> dict:
    """``cfg``: another shape, named ``model`` in the output (a test's small one). ``sections``:
    the steps to run (a larger model may fit this machine's memory one step at a time).
    ``folder``: a checkpoint folder (a release downloaded, say) that step 1 loads as it is; its
    config is the shape of every step, the others on seeded weights."""
    if folder is not None:
        cfg, model = ModelConfig.from_json(Path(folder) / "config.json"), Path(folder).resolve().name
        print(f"checkpoint folder {folder} on {machine()}")
    else:
        cfg = cfg or config_of(model)
        print(f"released shape {model} (random weights) on {machine()}")
    out: dict = {"machine": machine(), "model": model}
    checks: list[dict] = []
    if 1 in sections:
        print("1. loading a checkpoint folder")
        loaded = out["load"] = load_ratio(cfg, rounds, folder=folder)
        if loaded["cold_load_s"] is not None:
            checks.append(verdict(f"{model}: load / read its files, from the disk",
                                  loaded["cold_load_s"] / loaded["cold_read_s"], 2.0, False))
        else:
            print(f"  {NO_DISK}: the target (<= 2x, from the disk) is not checked")
    if 2 in sections:
        print("2. parity with transformers (fp32)")
        out["parity"] = parity(cfg)
        gc.collect()   # each step's models freed before the next builds its own (2B in fp32 is 9 GB)
    if 3 in sections:
        print("3. prefill and decode against transformers")
        speed = out["runtime"] = runtime.run("cpu", prompt, tokens, rounds, cfg=cfg, label=model)
        checks += [dict(c, name=f"{model}: {c['name']}") for c in speed["checks"]]
        gc.collect()
    if 4 in sections:
        print("4. capsules")
        with Engine.from_config(cfg, max_seq_len=max(ttft) + capsules.SUFFIX + 64) as engine:
            copies = out["copies"] = capsules.copy_ratios(engine, [p for p in (256, 1024, 2048) if p <= max(ttft)],
                                                          rounds)
            out["ttft"] = capsules.ttft(engine, list(ttft), rounds)
            out["sizes"] = capsules.size_account(engine)
            out["draws"] = draw_costs(engine, tokens, rounds)
        checks += [verdict(f"{model}: restore / copy at {r['bytes'] / 2**20:.1f} MiB", r["restore_ratio"], 1.3, False)
                   for r in copies if r["bytes"] >= 4 * 2**20]
    return out | {"peak_rss_gib": peak_rss_gib(), "checks": checks}


def main() -> None:
    def arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", default="Qwen3.5-0.8B", choices=sorted(RELEASED))
        parser.add_argument("--prompt", type=positive_int, default=512)
        parser.add_argument("--tokens", type=positive_int, default=16)
        parser.add_argument("--rounds", type=positive_int, default=3)
        parser.add_argument("--ttft", type=lambda s: tuple(positive_int(x) for x in s.split(",")), default=(2048,))
        parser.add_argument("--sections", type=_sections, default=SECTIONS,
                            help="the steps to run, e.g. 4 or 1,4 (default all: 1,2,3,4)")
        parser.add_argument("--folder", type=_folder, default=None,
                            help="a checkpoint folder for step 1 to load as it is, in place of --model's shape "
                                 "saved with seeded weights (its config.json is every step's shape)")

    bench_main(__doc__, arguments, lambda a: run(a.model, a.prompt, a.tokens, a.rounds, a.ttft, sections=a.sections,
                                                 folder=a.folder), device=False)


def _folder(text: str) -> Path:
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a checkpoint folder (no config.json in it)")
    return Path(text)


def _sections(text: str) -> tuple[int, ...]:
    chosen = tuple(sorted({positive_int(x) for x in text.split(",")}))
    if not set(chosen) <= set(SECTIONS):
        raise argparse.ArgumentTypeError(f"sections are {', '.join(map(str, SECTIONS))}")
    return chosen


if __name__ == "__main__":
    main()
