"""Train a byte-level language model on Python source: a main model whose next token can be learnt.

A random model's next token is a chaotic function of its context: an MTP head distilled from one
fits its training sequences and drafts nothing on others. Speculative decoding is only measured
meaningfully on a trained model, and none can be downloaded here, so this trains one: the bench
config's backbone (hidden 512, 8 layers at 3 linear : 1 full) with the byte vocabulary of the
embedded default, on the source files of the Python standard library that runs it (present on
every machine), with transformers' ``Qwen3_5ForCausalLM`` as the differentiable reference.

``--size tiny`` trains the embedded default's backbone the same way: the shipped test checkpoint
``data/spec_tiny``. It is a small model trained for minutes: its greedy text is code-like and repetitive, as an
undertrained model's is. That makes its drafts easier to accept than a released checkpoint's;
the benchmark says so beside every figure it measures on it.

Deterministic for a seed, a Python version and a thread count on one machine.
"""
from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from pathlib import Path

import torch

from ..runtime import ModelConfig
from ..runtime.tokenizer import BOS, EOS

_NOT_HF = ("architectures", "model_type", "mtp_num_hidden_layers", "obs_dim", "action_dim")


SIZES = {"bench": ModelConfig.bench, "tiny": ModelConfig.tiny}


def config(size: str = "bench") -> ModelConfig:
    """A size's backbone (the bench config's, or the embedded default's) with the byte
    vocabulary (256 bytes and 4 specials)."""
    return SIZES[size](vocab_size=260, eos_token_ids=(EOS,))


def corpus() -> torch.Tensor:
    """The standard library's top-level .py files, sorted by name, each as BOS + bytes + EOS."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    parts = []
    for f in files:
        parts += [BOS, *f.read_bytes(), EOS]
    return torch.tensor(parts, dtype=torch.int64)


def build(cfg: ModelConfig, seed: int):
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    transformers.logging.set_verbosity_error()   # it warns that fla/causal_conv1d kernels are absent
    torch.manual_seed(seed)
    hf = Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_config().items() if k not in _NOT_HF})
    return Qwen3_5ForCausalLM(hf)


def train(cfg: ModelConfig, steps: int, batch: int, length: int, lr: float, seed: int, log_every: int = 10):
    data = corpus()
    model = build(cfg, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    warmup = max(1, steps // 20)
    start = time.monotonic()
    for step in range(1, steps + 1):
        scale = step / warmup if step <= warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))
        for group in opt.param_groups:
            group["lr"] = lr * scale
        at = torch.randint(0, data.numel() - length, (batch,), generator=gen)
        ids = torch.stack([data[a:a + length] for a in at.tolist()])
        loss = model(input_ids=ids, labels=ids).loss   # transformers shifts the labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % log_every == 0 or step == steps:
            print(f"  step {step:5d}  loss {loss.item():.3f} nats/byte  {time.monotonic() - start:.0f} s", flush=True)
    return model.eval(), loss.item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashrt_ros.distill.train_lm", description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="checkpoint folder to write (config.json + model.safetensors)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=sorted(SIZES), default="bench",
                        help="backbone: the bench config's (the benchmark's) or the embedded default's (the tests')")
    args = parser.parse_args(argv)
    cfg = config(args.size)
    print(f"training {cfg.hidden_size}-wide, {cfg.num_hidden_layers}-layer byte model on {corpus().numel()} bytes "
          f"of Python {sys.version.split()[0]} source", flush=True)
    model, loss = train(cfg, args.steps, args.batch, args.length, args.lr, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    print(f"wrote {args.out} (final loss {loss:.3f} nats/byte)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
