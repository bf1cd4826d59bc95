"""A drafter for measurement, not for serving: the drafts of a head whose acceptance is known,
so that a benchmark or a test can set the acceptance a speculative pass sees."""
from __future__ import annotations

import torch

from ..runtime.speculative import Speculation


class KnownDrafts:
    """A drafter for measurement: the drafts of a head whose acceptance is known. It runs the
    MTP layer's steps (their cost and their KV rows, as a real pass has them), then drafts
    ``continuation``, the tokens plain decode commits from position ``start`` on, except that a
    share ``wrong`` of the positions (by a hash of the position) is drafted one token off."""

    def __init__(self, spec: Speculation, continuation: list[int], start: int, wrong: float,
                 vocab_size: int) -> None:
        self.spec, self.continuation, self.start = spec, continuation, start
        self.wrong, self.vocab_size = wrong, vocab_size

    def _off(self, position: int) -> bool:
        return (position * 2654435761) % (1 << 32) < self.wrong * (1 << 32)

    def __call__(self, token: torch.Tensor, position: int, count: int) -> torch.Tensor:
        made = self.spec.mtp_drafts(token, position, count)
        out = []
        for at in range(position + 1, position + 1 + count):
            row = at - self.start
            t = self.continuation[row] if 0 <= row < len(self.continuation) else 0
            out.append((t + 1) % self.vocab_size if self._off(at) else t)
        return torch.tensor(out, dtype=torch.int64, device=made.device)
