"""flashrt-train-mtp: distil an MTP head from a model's own greedy outputs, for speculative decoding.

A checkpoint whose MTP layer is missing (transformers drops ``mtp.*`` when it saves a model) or
seeded drafts nothing useful. This trains one on what the model itself does:

1. The engine decodes greedily from seeded prompts (plain decode, the state's own path), then
   one prefill of each whole sequence gives the main model's final hidden state per row.
2. The MTP layer (``mtp_layer.MtpLayer``) learns, for every row t, to choose what the main
   model chooses after row t, from token t and the hidden state of row t - 1: cross-entropy
   against the main model's greedy choices, the embedding and lm_head frozen.
3. The draft vocabulary is the fewest tokens covering ``--coverage`` of those choices, when that
   is under a quarter of the vocabulary: a draft then reads those lm_head columns only.
4. The engine, given the head, decodes held-out prompts speculatively: the acceptance it reports
   goes into the head file's metadata, and the tokens must equal plain decode's.

Deterministic for a seed on one machine and thread count.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..replay import verdicts
from ..runtime import Engine, ModelConfig
from ..runtime import mtp_head, weights as weights_io
from ..runtime.tokenizer import load_tokenizer
from .mtp_layer import MtpLayer

CONFIGS = {"tiny": ModelConfig.tiny, "bench": ModelConfig.bench}


def prompts(vocab: int, count: int, seed: int, lengths: tuple[int, int] = (4, 16)) -> list[list[int]]:
    """Seeded random prompts of token ids (the tokens a model's own greedy text starts from)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        out.append(torch.randint(0, vocab, (n,), generator=gen).tolist())
    return out


def text_prompts(ids: torch.Tensor, count: int, seed: int, lengths: tuple[int, int] = (16, 64)) -> list[list[int]]:
    """Seeded slices of a token stream (a corpus of the model's own domain)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        n = int(torch.randint(lengths[0], lengths[1] + 1, (1,), generator=gen))
        at = int(torch.randint(0, ids.numel() - n, (1,), generator=gen))
        out.append(ids[at:at + n].tolist())
    return out


def read_prompts(path: Path, model: str, vocab_size: int) -> torch.Tensor:
    """The token ids of a text file, or of a folder's .py, .txt and .md files (sorted), through
    the checkpoint's tokenizer, or as bytes for a byte-vocabulary model that has none."""
    files = sorted(f for f in path.glob("*") if f.suffix in (".py", ".txt", ".md")) if path.is_dir() else [path]
    text = b"\n".join(f.read_bytes() for f in files)
    tokenizer = load_tokenizer(model)
    if tokenizer is not None:
        return torch.tensor(tokenizer.encode(text.decode("utf-8", errors="replace")), dtype=torch.int64)
    if vocab_size < 256:
        raise SystemExit(f"{model} has no tokenizer.json and no byte vocabulary: --prompts cannot be read")
    return torch.tensor(list(text), dtype=torch.int64)


def sequences(engine: Engine, starts: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy continuations of ``starts`` to ``length`` tokens: tokens [B, T] and the main model's
    final hidden states [B, T, H] (from one prefill of each whole sequence)."""
    tokens, hidden = [], []
    for start in starts:
        engine.reset()
        engine.prefill(start)
        ids = start + engine.generate(length - len(start))
        engine.reset()
        with engine.lock, torch.inference_mode():
            rows = engine.model.prefill(torch.tensor(ids, device=engine.device), 0)
            hidden.append(rows.float().cpu().clone())
        engine.reset()
        tokens.append(torch.tensor(ids))
    return torch.stack(tokens), torch.stack(hidden)


def draft_vocab(choices: torch.Tensor, vocab_size: int, coverage: float) -> torch.Tensor | None:
    """The fewest token ids covering ``coverage`` of ``choices``, sorted; None past a quarter of the vocabulary."""
    counts = torch.bincount(choices.flatten(), minlength=vocab_size)
    order = counts.argsort(descending=True, stable=True)
    covered = counts[order].cumsum(0).double() / counts.sum()
    keep = int((covered < coverage).sum()) + 1
    return None if keep > vocab_size // 4 else order[:keep].sort().values


def chained_loss(layer: MtpLayer, tokens: torch.Tensor, prev: torch.Tensor, targets: torch.Tensor,
                 chain: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of ``chain`` chained draft steps, and the first step's logits.

    Step 1 pairs token t with the main model's hidden state of row t - 1; step c + 1 pairs it
    with step c's own output at row t - 1, as ``Qwen35.draft`` chains (its inputs are the
    accepted tokens, which equal the main model's). Each step is trained to the main model's
    choice after row t."""
    losses, first = [], None
    for _ in range(chain):
        hidden = layer(tokens, prev)
        logits = layer.logits(hidden)
        first = logits if first is None else first
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        prev = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
    return torch.stack(losses).mean(), first


def train(layer: MtpLayer, tokens: torch.Tensor, prev: torch.Tensor, targets: torch.Tensor, steps: int,
          batch: int, lr: float, seed: int, chain: int = 1, log_every: int = 50) -> list[tuple[int, float, float]]:
    """Adam with a cosine schedule over ``chained_loss``; returns (step, loss, first-step agreement)
    every ``log_every`` steps."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(layer.parameters(), lr=lr)
    history = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * (step - 1) / steps))
        pick = torch.randint(0, tokens.shape[0], (batch,), generator=gen).to(tokens.device)
        loss, logits = chained_loss(layer, tokens[pick], prev[pick], targets[pick], chain)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % log_every == 0 or step == steps:
            agree = float((logits.argmax(-1) == targets[pick]).float().mean())
            history.append((step, loss.item(), agree))
            print(f"  step {step:5d}  loss {loss.item():.4f}  agreement {agree:.3f}", flush=True)
    return history


def acceptance(build, head: dict[str, torch.Tensor], starts: list[list[int]], length: int,
               drafts: tuple[int, ...]) -> dict[str, float]:
    """Speculative decoding with ``head`` on held-out prompts, per drafts per pass: acceptance
    and tokens per pass. Raises if the tokens differ from plain decode's: on the CPU backend at
    all (its verify rows are decode's bytes), elsewhere other than after a near-tie of plain
    decode's choice (``replay.verdicts.token_run``: products of several rows round otherwise than
    of one), which is counted and said."""
    out = {}
    with build(head) as engine:
        # Every pass counts: the switch-off would stop drafting, and the count, where a head is poor.
        engine.speculation.break_even = 0.0
        plain = []
        for start in starts:
            engine.reset()
            engine.prefill(start)
            plain.append([(token, margin) for token, margin, _ in engine.stream(length, sync_every=0, scored=True)])
        for k in drafts:
            before, ties = engine.speculation_stats, 0
            for start, expected in zip(starts, plain):
                engine.reset()
                engine.prefill(start)
                outcome, detail = verdicts.token_run(expected, engine.generate(length, speculative=k))
                if outcome == verdicts.DIFFERS or (outcome == verdicts.TIE and engine.cpu_kernels):
                    raise RuntimeError(f"speculative decoding with {k} drafts gave other tokens than plain decode "
                                       f"({detail})")
                ties += outcome == verdicts.TIE
            if ties:
                print(f"  {k} drafts: {ties} of {len(starts)} held-out prompts left plain decode's tokens at a "
                      f"near-tie", flush=True)
            after = engine.speculation_stats
            passes, drafted = after.passes - before.passes, after.drafted - before.drafted
            accepted = after.accepted - before.accepted
            out[f"acceptance_k{k}"] = accepted / drafted if drafted else 0.0
            out[f"tokens_per_pass_k{k}"] = (passes + accepted) / passes if passes else 0.0
    return out


def distill(cfg: ModelConfig, weights: dict[str, torch.Tensor], build, *, sequences_n: int, length: int,
            steps: int, batch: int, lr: float, seed: int, coverage: float, chain: int = 1,
            corpus: torch.Tensor | None = None, held_out: int = 8) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The head's tensors and metadata. ``build(head)`` makes an engine of the model with ``head``
    (``None``: as it is) as a context manager. Prompts are slices of ``corpus`` (token ids),
    or random token ids without one."""
    def starts(count: int, seed: int) -> list[list[int]]:
        return prompts(cfg.vocab_size, count, seed) if corpus is None else text_prompts(corpus, count, seed)

    t0 = time.monotonic()
    with build(None) as engine:
        device = engine.device
        tokens, hidden = sequences(engine, starts(sequences_n, seed), length)
        lm_head = engine.model.lm_head.w.t().float()
        embed = engine.model.embed.float()
    print(f"{sequences_n} sequences of {length} tokens in {time.monotonic() - t0:.0f} s", flush=True)
    tokens, hidden = tokens.to(device), hidden.to(device)
    targets = (hidden @ lm_head.t()).argmax(-1)                     # the main model's choice after each row
    prev = torch.cat([torch.zeros_like(hidden[:, :1]), hidden[:, :-1]], 1)
    start = {n: t for n, t in weights.items() if n.startswith("mtp.")}
    layer = MtpLayer(cfg, start, embed, lm_head, max_len=length).to(device)
    torch.manual_seed(seed)
    history = train(layer, tokens, prev, targets, steps, batch, lr, seed, chain)
    head = {n: t.cpu() for n, t in layer.state().items()}
    vocab = draft_vocab(targets.cpu(), cfg.vocab_size, coverage)
    if vocab is not None:
        head[mtp_head.DRAFT_VOCAB] = vocab
    measured = acceptance(build, head, starts(held_out, seed + 1), length // 2, (1, 2, 3))
    meta = {"distilled_from": mtp_head.base_fingerprint(cfg, weights), "seed": str(seed),
            "sequences": str(sequences_n), "length": str(length), "steps": str(steps), "chain": str(chain),
            "final_loss": f"{history[-1][1]:.5f}", "train_agreement": f"{history[-1][2]:.4f}",
            "draft_vocab": str(0 if vocab is None else vocab.numel())}
    meta |= {k: f"{v:.4f}" for k, v in measured.items()}
    print(json.dumps(meta, indent=1), flush=True)
    print(f"done in {time.monotonic() - t0:.0f} s", flush=True)
    return head, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashrt-train-mtp", description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="",
                        help="a checkpoint folder, or 'tiny' / 'bench' for the seeded configs (default: tiny)")
    parser.add_argument("--out", type=Path, required=True, help="head file to write")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--coverage", type=float, default=0.999,
                        help="share of the model's choices the draft vocabulary covers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chain", type=int, default=3,
                        help="draft steps trained in a chain (each on the one before's output)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model decodes and the head trains")
    parser.add_argument("--prompts", type=Path, help="a text file or a folder of them: prompts are slices of it "
                                                     "(default: random token ids)")
    args = parser.parse_args(argv)
    name = args.model or "tiny"
    if name in CONFIGS:
        cfg = CONFIGS[name]()
        weights = weights_io.seeded_weights(cfg, 0)
    else:
        cfg, weights, _ = weights_io.load_checkpoint(name)
    out = args.out

    def build(head: dict[str, torch.Tensor] | None) -> Engine:
        return Engine(cfg, weights | (head or {}), device=args.device, max_seq_len=2 * args.length + 96)

    corpus = None if args.prompts is None else read_prompts(args.prompts, "" if name in CONFIGS else name,
                                                             cfg.vocab_size)
    head, meta = distill(cfg, weights, build, sequences_n=args.sequences, length=args.length, steps=args.steps,
                         batch=args.batch, lr=args.lr, seed=args.seed, coverage=args.coverage,
                         chain=args.chain, corpus=corpus)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, suffix=".tmp", delete=False) as tmp:
        pass
    mtp_head.save(tmp.name, head, meta)
    Path(tmp.name).replace(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
