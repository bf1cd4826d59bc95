"""make train-policy: behaviour-clone the reaching policy and export a checkpoint the engine loads.

The policy is the embedded default's Qwen3.5-style backbone (``ModelConfig.tiny``: three Gated
DeltaNet layers and one full-attention layer) with the observation projector and the action
head, trained end to end on the expert's demonstrations (``demonstrations``). The
differentiable reference is transformers' ``Qwen3_5ForCausalLM`` taking ``inputs_embeds``: the
engine reproduces it (test_model_matches_transformers), so the exported weights act the same
in either. The checkpoint is config.json and model.safetensors with transformers' key names
plus ``policy.*``, as ``Engine.from_pretrained`` reads them.

Deterministic for a seed on one machine and thread count (torch's CPU kernels are); another
CPU may round differently and end at another, equally good, checkpoint.
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

from ..runtime import Engine, ModelConfig
from .arm import Arm
from .demonstrations import demonstrate
from .rollout import reach
from .task import ACTION_DIM, OBS_DIM, Episode

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "data" / "policies" / "reach_arm"
TRAIN_SEEDS = range(10_000, 12_000)
DAGGER_EPISODES = 1000
HELD_OUT_SEEDS = range(0, 100)   # undisturbed episodes, never trained on (the ablation's are 500-519)
_NOT_HF = ("architectures", "model_type", "mtp_num_hidden_layers", "obs_dim", "action_dim")


def policy_config() -> ModelConfig:
    return ModelConfig.tiny(obs_dim=OBS_DIM, action_dim=ACTION_DIM)


def build(cfg: ModelConfig, seed: int) -> torch.nn.ModuleDict:
    import transformers
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    transformers.logging.set_verbosity_error()   # it warns that fla/causal_conv1d kernels are absent
    torch.manual_seed(seed)
    hf = Qwen3_5TextConfig(**{k: v for k, v in cfg.to_hf_config().items() if k not in _NOT_HF})
    return torch.nn.ModuleDict({"lm": Qwen3_5ForCausalLM(hf), "obs_proj": torch.nn.Linear(cfg.obs_dim, cfg.hidden_size),
                                "action_head": torch.nn.Linear(cfg.hidden_size, cfg.action_dim)})


def actions(model: torch.nn.ModuleDict, observations: torch.Tensor, chunk_size: int | None = None) -> torch.Tensor:
    """Actions for [batch, steps, obs] observations. ``chunk_size``: the chunk length of
    transformers' chunked Gated DeltaNet (None: its default); the chunked form is exact for
    any length, so only the rounding and the cost change with it."""
    extra = {} if chunk_size is None else {"chunk_size": chunk_size}
    hidden = model["lm"].model(inputs_embeds=model["obs_proj"](observations), **extra).last_hidden_state
    return model["action_head"](hidden)


def train(seed: int = 0, iterations: int = 1200, rounds: int = 2, batch: int = 32, lr: float = 2e-3,
          log_every: int = 100) -> tuple[torch.nn.ModuleDict, list[tuple[int, float]]]:
    """The trained model, and (iteration, loss) at every ``log_every``: ``iterations`` on the
    expert's demonstrations, then ``rounds`` of DAgger, each adding the episodes the policy of
    the round before drives (labelled by the expert) and training ``iterations`` more."""
    demos = demonstrate(TRAIN_SEEDS)
    x, y = torch.from_numpy(demos.observations), torch.from_numpy(demos.targets)
    model = build(policy_config(), seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses: list[tuple[int, float]] = []
    total = iterations * (rounds + 1)
    for it in range(total):
        if it and it % iterations == 0:   # a DAgger round: the policy so far drives, the expert labels
            with tempfile.TemporaryDirectory() as folder:
                export(model, Path(folder))
                engine = Engine.from_pretrained(folder, max_seq_len=256)
                start = TRAIN_SEEDS.stop + (it // iterations) * DAGGER_EPISODES
                more = demonstrate(range(start, start + DAGGER_EPISODES), policy=engine)
                engine.close()
            x = torch.cat([x, torch.from_numpy(more.observations)])
            y = torch.cat([y, torch.from_numpy(more.targets)])
        for group in opt.param_groups:   # cosine decay to a tenth
            group["lr"] = lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / total)))
        rows = torch.randint(0, x.shape[0], (batch,), generator=gen)
        loss = torch.nn.functional.mse_loss(actions(model, x[rows]), y[rows])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if it % log_every == 0 or it == total - 1:
            losses.append((it, loss.item()))
    return model, losses


def export(model: torch.nn.ModuleDict, out: Path) -> None:
    from safetensors.torch import save_file

    cfg = policy_config()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in model["lm"].state_dict().items()}
    for head in ("obs_proj", "action_head"):
        for name, t in model[head].state_dict().items():
            tensors[f"policy.{head}.{name}"] = t.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    config = {**cfg.to_hf_config(), "obs_dim": cfg.obs_dim, "action_dim": cfg.action_dim, "mtp_num_hidden_layers": 0}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def success_rate(path: Path, seeds: range = HELD_OUT_SEEDS) -> float:
    """Undisturbed episodes the exported policy completes, run by the engine."""
    engine = Engine.from_pretrained(path, max_seq_len=256)
    arm = Arm()
    try:
        return sum(reach(engine, arm, Episode.sample(s)).success for s in seeds) / len(seeds)
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make train-policy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"checkpoint folder (default {DEFAULT_OUT})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=1200, help="iterations per round (default 1200)")
    parser.add_argument("--rounds", type=int, default=2, help="DAgger rounds after the first (default 2)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    model, losses = train(args.seed, args.iterations, args.rounds)
    took = time.monotonic() - started
    for it, loss in losses:
        print(f"iteration {it:5d}  loss {loss:.5f}")
    export(model, args.out)
    rate = success_rate(args.out)
    print(f"trained in {took:.0f} s on {torch.get_num_threads()} threads: final loss {losses[-1][1]:.5f}, "
          f"held-out success {rate:.0%} of {len(HELD_OUT_SEEDS)} undisturbed episodes; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
