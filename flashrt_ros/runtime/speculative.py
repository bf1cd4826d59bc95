"""Self-speculative decoding with the model's MTP layer: its drafter, counts and switch-off rule.

One pass, under the engine lock: the main model's next token x (from the logits it already
has), up to k draft tokens chained by the MTP layer, then one verify forward of [x, drafts]
over the weights (``Qwen35.verify``). The drafts agree with the main model's own choices for
some prefix; x and that prefix are committed, one boundary each, and the main model's choice
after the last of them is the next pass's x. A draft that disagrees has already moved the
recurrent and conv state, so the verify returns the fixed-size state after every row and the
pass (``decoding.Decoder.speculate``) loads the one of the last accepted row: the same bytes a plain
decode step leaves, which is also what the rollback ring keeps per committed token.

Exactness rests on ``verify`` computing each row as a decode step does alone. On the CPU
backend every product is the row kernel's, whose rows sum in one order whatever their number,
so accepted rows are plain decode's bytes. The torch reference path multiplies the rows with
one ``x @ w``, which may round otherwise than one row does; tokens then agree wherever the
choice's margin exceeds that rounding (the exactness tests say how much).

A draft costs a pass over the MTP layer and the draft head; a pass pays only when enough
drafts are accepted. ``Speculation.record`` turns speculation off for a while when the
acceptance over a window of passes stays under the break-even that the weight bytes give.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from .models.qwen35 import Qwen35

# Passes whose acceptance decides whether speculation pays, and plain tokens before it is tried again.
WINDOW = 16
BACKOFF = 256
# A verify row costs more than its share of the weight bytes (its products' arithmetic, and its
# attention and linear mixer, which run alone); break-even asks this much more acceptance than
# the bytes alone would. Where it lies is what bench.speculative's known-draft rows measure.
OVERHEAD = 1.5


@dataclass(slots=True)
class SpeculationStats:
    """Counts since the engine was built: verify passes, drafts made and accepted, tokens
    decoded one at a time while speculation was off, and how often it was turned off."""

    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    plain_tokens: int = 0
    turned_off: int = 0

    @property
    def acceptance(self) -> float:
        """Accepted drafts per draft made (0 before any)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Committed tokens per verify pass, the main model's own token included."""
        return (self.passes + self.accepted) / self.passes if self.passes else 0.0


# What makes the drafts of a pass: (the main model's token [1], its position, count) -> [count].
Drafter = Callable[[torch.Tensor, int, int], torch.Tensor]


class Speculation:
    """The drafter, the counts, and the rule that switches speculation off while it does not pay.

    ``drafter`` is the MTP layer (``Qwen35.draft`` over the draft vocabulary); a benchmark or a
    test may set another one (it must leave the arena as the MTP layer's does, which calling
    that first guarantees). ``break_even``: the acceptance under which a window of passes turns
    speculation off; 0 keeps it on whatever the acceptance.
    """

    def __init__(self, model: Qwen35, max_draft: int, draft_vocab: torch.Tensor | None = None) -> None:
        self.max_draft = max_draft
        self.vocab = self.head = None
        if draft_vocab is not None:
            # The lm_head columns of the draft vocabulary, their own copy, [H, V'].
            self.vocab = draft_vocab.to(model.device)
            self.head = model.lm_head.w.index_select(1, self.vocab).contiguous()
        self.stats = SpeculationStats()
        head = self.head if self.head is not None else model.lm_head.w
        draft = [p.w for p in model.draft_projections()] + [model.mtp_fc.w, model.mtp_kv_proj.w, head]
        # A draft of an MoE model reads its MTP layer's k routed experts too.
        self.draft_bytes = sum(t.numel() * t.element_size() for t in draft) + model.mtp.mlp.routed_bytes()
        # Accepted per draft made for a pass to cost no more per token than plain decode: a pass
        # of k drafts reads the weights once plus k drafts' bytes and commits 1 + accepted tokens.
        self.break_even = min(1.0, OVERHEAD * self.draft_bytes / model.weight_bytes_per_token())
        self._recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)
        self._off_for = 0
        self.drafter: Drafter = self.mtp_drafts
        self._model = model

    def mtp_drafts(self, token: torch.Tensor, position: int, count: int) -> torch.Tensor:
        """The MTP layer's drafts (the default drafter)."""
        return self._model.draft(token, position, count, self.vocab, self.head)

    def restart(self) -> None:
        """Forget the passes so far: the next ones decide afresh whether speculation pays."""
        self._recent.clear()
        self._off_for = 0

    def wanted(self) -> bool:
        """Whether the next token should come from a pass (False while switched off: each call
        then counts one plain token)."""
        if self._off_for:
            self._off_for -= 1
            self.stats.plain_tokens += 1
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        """A pass made ``drafted`` drafts and ``accepted`` of them were committed."""
        s = self.stats
        s.passes, s.drafted, s.accepted = s.passes + 1, s.drafted + drafted, s.accepted + accepted
        self._recent.append((drafted, accepted))
        if len(self._recent) == WINDOW:
            made = sum(d for d, _ in self._recent)
            if sum(a for _, a in self._recent) < self.break_even * made:
                self._off_for = BACKOFF
                self._recent.clear()
                s.turned_off += 1

