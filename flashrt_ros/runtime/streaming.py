"""Streaming tokens: each turn of the engine lock commits one token, or one speculative pass,
into a device-side list; the list is read back (one device sync) every ``sync_every`` tokens
and yielded outside the lock, so a consumer that takes its time holds nobody up.

Another caller may restore, roll back or reset between two turns: the stream then stops
(``Preempted``) rather than go on from a state it did not build.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from ..errors import Preempted
from .decoding import Pass
from .live_state import LiveState
from .sampling import Sampling


@dataclass(frozen=True, slots=True)
class Request:
    """A checked stream request: ``n`` tokens, read back every ``sync_every`` (0: all at the
    end), chosen as ``sampling`` says, the RNG state set to ``seed`` before the first
    (None: left as it is), plain tokens or ``scored`` (token, margin, position) triples, and up
    to ``drafts`` drafts per speculative pass (0: plain decode)."""

    n: int
    sync_every: int
    sampling: Sampling
    seed: int | None
    scored: bool
    drafts: int


def stream(live: LiveState, work: Callable[[], AbstractContextManager[None]], request: Request,
           lineage: int) -> Iterator[int] | Iterator[tuple[int, float, int]]:
    """Commit the request's tokens on ``live``, each turn inside ``work()`` (the engine lock),
    and yield them outside it. ``lineage``: the live state's when the request was made; once
    it differs, the tokens committed so far are yielded and Preempted is raised."""
    landed = _Landed(request.n, request.scored, live.arena.device)
    read = done = 0
    last: Pass | None = None   # the last speculative pass: its logits follow its end
    while done < request.n:
        with work():
            replaced = live.state.lineage != lineage
            if not replaced:
                tokens, margins, last = _next(live, request, done, last)
                landed.put(done, tokens, margins, live.state.position)
        if replaced:   # yielded outside the lock: the consumer may take its time
            yield from landed.read(read, done)
            raise Preempted(f"a restore or rollback (or a reset) replaced the live state after {done} of "
                            f"{request.n} tokens; the stream stopped there")
        done += tokens.shape[0]
        if request.sync_every and done - read >= request.sync_every:
            yield from landed.read(read, done)
            read = done
    if read < request.n:
        yield from landed.read(read, request.n)


def _next(live: LiveState, request: Request, done: int,
          last: Pass | None) -> tuple[torch.Tensor, torch.Tensor, Pass | None]:
    """Commit the token after the ``done`` ones, or a speculative pass of up to ``request.drafts``
    drafts (fewer near the end of the request or of the context): (tokens, margins, the pass or None)."""
    live.check_room(1)
    if done == 0 and request.seed is not None:
        live.model.rng_seed.fill_(int(request.seed))
    how = request.sampling
    if how.sampled:   # set per step: another caller's stream may have set its own
        live.model.use_sampling(how)
    if request.drafts and live.decoder.speculation.wanted():
        k = min(request.drafts, request.n - done - 1, live.max_seq_len - live.state.position - 1)
        if k >= 1:
            made = live.speculative_pass(k, how, last)
            return made.tokens, made.margins, made
    token, margin = live.token(how)
    return token, margin, None


class _Landed:
    """The stream's tokens on the device, written under the lock as they are committed, and
    with ``scored`` each one's margin and the position its boundary left."""

    def __init__(self, n: int, scored: bool, device: torch.device) -> None:
        self.tokens = torch.empty(n, dtype=torch.int64, device=device)
        self.margins = torch.empty(n if scored else 0, dtype=torch.float64, device=device)
        self.ends: list[int] | None = [] if scored else None

    def put(self, at: int, tokens: torch.Tensor, margins: torch.Tensor, end: int) -> None:
        """The tokens committed from stream index ``at`` on, the last of them leaving position ``end``."""
        count = tokens.shape[0]
        self.tokens[at:at + count] = tokens
        if self.ends is not None:
            self.margins[at:at + count] = margins
            self.ends.extend(range(end - count + 1, end + 1))

    def read(self, start: int, end: int) -> list:
        """Tokens [start, end) (triples when scored), read back with one device sync."""
        tokens = self.tokens[start:end].tolist()
        if self.ends is None:
            return tokens
        return list(zip(tokens, self.margins[start:end].tolist(), self.ends[start:end]))
