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
"""
from __future__ import annotations

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


def scores(logits: torch.Tensor, temperature: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
           index: torch.Tensor) -> torch.Tensor:
    """The float64 scores [V] whose argmax is a draw from softmax(logits / temperature); logits [1, V].

    The largest logit is taken off first, so every scaled score is <= 0: at a
    temperature small enough to overflow the others go to -inf and the draw is
    the greedy token, never an +inf that ties with others."""
    scaled = logits[0].double()
    scaled = (scaled - scaled.max()) / temperature.double()
    return scaled + gumbel_noise(seed, position, index)


def margin(scores: torch.Tensor) -> torch.Tensor:
    """The gap [1] between the two highest of ``scores`` [V]: how far the choice was from a tie.

    A replay on another platform, whose scores differ in their low bits, can choose
    another token only where this gap is about as small as those differences."""
    top = scores.topk(2).values
    return (top[0] - top[1]).reshape(1)
