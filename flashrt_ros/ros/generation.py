"""One generate goal: prompt in, tokens out, one committed boundary per token.

The session commits the prompt, then one token per step, each under the engine lock, so a
service call that arrives mid-way waits for at most the step in progress. Cancel and
deactivate are checked after every token, i.e. at committed boundaries. A Restore or Rollback
that lands between two tokens replaces the state the goal was extending: the session's
tokens stop there (PREEMPTED), and the goal reports the tokens it made before.
"""
from __future__ import annotations

import time
from typing import Any, Iterator, NamedTuple

from ..action import Generate
from ..errors import InvalidArgument, NotActive
from ..runtime import Sampling, inputs
from ..serving import Session


class _Asked(NamedTuple):
    """A goal's request, checked: prompt ids, new tokens, sampling and drafts per pass."""

    ids: list[int]
    new_tokens: int
    sampling: Sampling
    seed: int | None
    drafts: int


def run_generation(node: Any, session: Session, goal_handle: Any, result: Any) -> None:
    """Fill ``result`` (and stream feedback); raise a FlashRTError to refuse or stop."""
    engine = session.engine
    goal = goal_handle.request
    asked = _checked(node, engine, goal)
    start = time.perf_counter()
    with engine.lock:
        # Asked again once the lock is ours: a goal that waited for it may have been canceled,
        # or the node deactivated, meanwhile; neither may find the prompt committed.
        if not node.serving:
            raise NotActive("node left the active state before the prompt was committed")
        if goal_handle.is_cancel_requested:   # the goal ends at the loop's first check
            asked = asked._replace(ids=[], new_tokens=0)
        stream = session.generate(asked.ids, asked.new_tokens, asked.sampling, seed=asked.seed,
                                  prompt=goal.prompt, speculative=asked.drafts or None)
    tokens: list[int] = []
    try:
        first = _streamed(node, engine, goal_handle, stream, tokens, result)
    finally:   # an aborted goal still reports the tokens it committed to the state
        result.tokens = tokens
        result.text = _decode(node.tokenizer, tokens)
    end = time.perf_counter()
    result.ttft_ms = ((first or end) - start) * 1e3
    decode_s = end - (first or end)
    result.tokens_per_s = (len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0
    result.position = engine.position


def _checked(node: Any, engine: Any, goal: Any) -> _Asked:
    ids = _prompt_ids(node.tokenizer, goal)
    n = goal.max_new_tokens
    if n < 0:
        raise InvalidArgument(f"max_new_tokens must be >= 0, got {n}")
    sampling = _sampling(engine, goal)
    if goal.speculative < -1:
        raise InvalidArgument(f"speculative must be -1 (the node's parameter), 0 (off) or drafts per pass, "
                              f"got {goal.speculative}")
    drafts = goal.speculative if goal.speculative >= 0 else node.get_parameter("speculative").value
    if not ids and engine.position == 0:
        raise InvalidArgument("empty prompt on an empty state: give a prompt or token_ids")
    room = engine.max_seq_len - engine.position
    if len(ids) + n > room:
        raise InvalidArgument(f"{len(ids)} prompt + {n} new tokens exceed the {room} positions left "
                              f"(max_seq_len={engine.max_seq_len}, position={engine.position})")
    return _Asked(ids, n, sampling, goal.seed if goal.seed >= 0 else None, drafts)


def _sampling(engine: Any, goal: Any) -> Sampling:
    """The goal's sampling, or with temperature -1 the checkpoint's (``Engine.sampling_defaults``)."""
    if goal.temperature == -1:
        return engine.sampling_defaults
    if goal.temperature < 0:
        raise InvalidArgument(f"temperature must be >= 0 (0: greedy), or -1 for the checkpoint's sampling; "
                              f"got {goal.temperature}")
    return inputs.sampling(float(goal.temperature), int(goal.top_k), float(goal.top_p))


def _streamed(node: Any, engine: Any, goal_handle: Any, stream: Iterator[int], tokens: list[int],
              result: Any) -> float | None:
    """Take tokens from ``stream`` into ``tokens``, with feedback, until it ends, an end-of-sequence
    token, a cancel or a deactivation (NotActive); return when the first token came (None: none)."""
    eos = set(engine.stop_token_ids) | {getattr(node.tokenizer, "eos_id", None)}
    first = None
    feedback = Generate.Feedback()
    while True:
        if goal_handle.is_cancel_requested:
            result.message = f"canceled after {len(tokens)} tokens"
            return first
        if not node.serving:
            raise NotActive(f"node left the active state after {len(tokens)} tokens")
        token = next(stream, None)
        if token is None:
            return first
        if first is None:
            first = time.perf_counter()
        tokens.append(token)
        feedback.tokens = tokens
        feedback.text = _decode(node.tokenizer, tokens)
        goal_handle.publish_feedback(feedback)
        if token in eos:
            return first


def _prompt_ids(tokenizer: Any, goal: Any) -> list[int]:
    if len(goal.messages):
        if len(goal.token_ids) or goal.prompt:
            raise InvalidArgument("a goal gives messages, a prompt or token_ids: one of them")
        if tokenizer is None:
            raise InvalidArgument("this checkpoint has no tokenizer.json: send token_ids instead of messages")
        return tokenizer.encode_chat([{"role": m.role, "content": m.content} for m in goal.messages])
    if len(goal.token_ids):
        return [int(t) for t in goal.token_ids]
    if not goal.prompt:
        return []
    if tokenizer is None:
        raise InvalidArgument("this checkpoint has no tokenizer.json: send token_ids instead of a prompt")
    return tokenizer.encode(goal.prompt)


def _decode(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode(tokens) if tokenizer is not None else ""
