"""Temperature sampling whose randomness is part of the state arena.

A token at position p is drawn by the Gumbel-max trick: argmax over the vocabulary
of logits / T + G, where G is Gumbel noise. The noise is a pure function of
(seed, p, vocabulary index), computed with integer hashing in tensor ops, so:

- the RNG state is the seed, one int64 in the arena, and the counter is the
  position that the arena holds anyway; a capsule, a rollback or a replay
  brings both back, and the same tokens are drawn again;
- nothing lives in a framework generator, whose state a restore would not see
  and whose draws a captured CUDA graph would repeat;
- the same code runs eagerly and inside a graph (seed and position are tensors).

The hash keeps every intermediate below 2**63: operands under 2**32, multipliers
under 2**27, so int64 arithmetic never overflows on any device.

Top-k and top-p (nucleus) truncation follow transformers' warpers, in their order: the
logits divided by the temperature, then all but the k largest dropped, then all but the
smallest set of the most probable whose mass reaches p (renormalised over what top-k left).
The cut is a threshold on the sorted logits: fixed shapes, no host sync, so that a captured
graph runs it; entries tied with the threshold are all kept.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_MASK = 0xFFFFFFFF
_MIX = 0x45D9F3B          # a 32-bit integer hash multiplier (under 2**27)
_GOLDEN = 0x9E3779B9      # spreads neighbouring indices before hashing


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective mix of 32-bit values held in int64 (every input in [0, 2**32))."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK
    x = (((x >> 16) ^ x) * _MIX) & _MASK
    return (x >> 16) ^ x


def gumbel_noise(seed: torch.Tensor, position: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise in float64 for every entry of ``index`` (int64 [V]), keyed by the
    int64 tensors ``seed`` [1] and ``position`` [1]."""
    folded = (seed ^ (seed >> 32)) & _MASK                       # all 64 bits of the seed count
    key = _hash32(folded ^ _hash32(position & _MASK))
    bits = _hash32(_hash32(((index & _MASK) * _GOLDEN + key) & _MASK) ^ key)
    uniform = (bits.double() + 0.5) * 2.0 ** -32                 # in (0, 1): both logs are finite
    return -torch.log(-torch.log(uniform))


@dataclass(frozen=True, slots=True)
class Sampling:
    """How a token is chosen: greedy (``temperature`` 0), or drawn from softmax(logits /
    temperature) restricted to the ``top_k`` most likely (0: all) and to the nucleus of mass
    ``top_p`` (1: all). ``inputs.sampling`` checks the values."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def as_kwargs(self) -> dict[str, float | int]:
        """The keywords of ``Engine.generate`` and ``Engine.stream`` that choose this way."""
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def truncated(self) -> bool:
        """Drawn from a cut of the vocabulary (a greedy choice ignores top-k and top-p)."""
        return self.sampled and (self.top_k > 0 or self.top_p < 1)


GREEDY = Sampling()


def scores(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
           index: torch.Tensor, cut: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The float64 scores [V] whose argmax is a draw from softmax(logits / temperature); logits [1, V].
    ``cut``: (top_k int64 [1], top_p float64 [1]); entries outside it score -inf.

    The largest logit is taken off first, so every scaled score is <= 0: at a
    temperature small enough to overflow the others go to -inf and the draw is
    the greedy token, never an +inf that ties with others."""
    scaled = logits[0].double()
    scaled = (scaled - scaled.max()) / temperature.double()
    if cut is not None:
        scaled = scaled.masked_fill(scaled < threshold(scaled, *cut), -math.inf)
    return scaled + gumbel_noise(seed, position, index)


def threshold(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The smallest of ``scaled`` [V] (logits / temperature) that top-k and then top-p keep, as a
    tensor [1]: the k-th largest, or higher where fewer than k hold the mass p."""
    ordered = scaled.sort(descending=True).values
    size = ordered.numel()
    ranks = torch.arange(size, device=scaled.device)
    k = torch.where(top_k > 0, top_k.clamp(max=size), size)                    # [1]
    probs = torch.softmax(ordered.masked_fill(ranks >= k, -math.inf), dim=0)    # renormalised over the top k
    before = probs.cumsum(0) - probs                                            # the mass above each entry
    nucleus = torch.where(top_p < 1, (before < top_p).sum(), size)              # the first always counts
    kept = torch.minimum(nucleus, k).clamp(min=1)
    return ordered.gather(0, kept - 1)


def margin(scores: torch.Tensor) -> torch.Tensor:
    """The gap [1] between the two highest of ``scores`` [V]: how far the choice was from a tie.

    A replay on another platform, whose scores differ in their low bits, can choose
    another token only where this gap is about as small as those differences."""
    top = scores.topk(2).values
    return (top[0] - top[1]).reshape(1)
