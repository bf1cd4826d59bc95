"""The two verdicts of a replay, judged per message (no ROS imports).

- exact: every output byte-identical, state digests included. It is promised on the recording's
  platform only (the same torch, kernels, device and CPU vendor).
- portable: what holds across platforms, whose products round differently in their low bits.
  Every token is the recorded one wherever the recorded margin between its two best scores
  exceeds ``Tolerance.margin`` (closer to a tie, another token is a *tie*, not a failure);
  every action is within ``Tolerance.action_atol + action_rtol * |recorded|``; every call has
  the recorded outcome, error code and position. State digests are exact-only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Portable outcomes of one comparison.
SAME, TIE, WITHIN, DIFFERS, EXACT_ONLY = "same", "tie", "within", "differs", "exact-only"


@dataclass(frozen=True)
class Tolerance:
    """``margin`` in logit units (a sampled token's scores are scaled back by its temperature)."""
    margin: float = 1e-3
    action_atol: float = 1e-4
    action_rtol: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("margin", "action_atol", "action_rtol"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and np.isfinite(value) and value >= 0):
                raise ValueError(f"tolerance {name} must be a finite number >= 0, got {value!r}")


@dataclass(frozen=True)
class Finding:
    """One output of one message that is not byte-identical; ``portable`` says how it is judged."""
    seq: int
    kind: str
    what: str
    recorded: Any
    replayed: Any
    portable: str
    detail: str = ""

    def line(self) -> str:
        return (f"seq={self.seq} ({self.kind}) {self.what}: exact differs, portable {self.portable}"
                + (f" ({self.detail})" if self.detail else "")
                + f"; recorded {_short(self.recorded)}, replayed {_short(self.replayed)}")


@dataclass
class Verdicts:
    entries: int = 0
    tokens: int = 0
    actions: int = 0
    capsule_calls: int = 0
    failures_reproduced: int = 0
    findings: list[Finding] = field(default_factory=list)
    largest_action_difference: float = 0.0
    stopped: Finding | None = None   # a difference the replay cannot go on from (an outcome or position)

    @property
    def exact(self) -> bool:
        return not self.findings

    @property
    def portable(self) -> bool:
        return not any(f.portable == DIFFERS for f in self.findings)

    def passes(self, verdict: str) -> bool:
        """Whether the verdict applied ("exact" or "portable") holds: what decides the exit status."""
        return self.exact if verdict == "exact" else self.portable

    @property
    def ties(self) -> int:
        return sum(f.portable == TIE for f in self.findings)

    def messages(self) -> dict[int, tuple[str, str]]:
        """Per message that differs in any output: (exact, portable), the worst of its findings."""
        rank = (EXACT_ONLY, WITHIN, TIE, DIFFERS)
        worst: dict[int, str] = {}
        for f in self.findings:
            if f.seq not in worst or rank.index(f.portable) > rank.index(worst[f.seq]):
                worst[f.seq] = f.portable
        return {seq: ("differs", "fail" if p == DIFFERS else "pass") for seq, p in worst.items()}


def token(recorded: int, margin: float | None, replayed: int, tol: Tolerance) -> tuple[str, str]:
    """(portable outcome, detail) of a token choice."""
    if recorded == replayed:
        return SAME, ""
    if margin is None:
        return DIFFERS, "the recording has no margin for this token"
    if margin <= tol.margin:
        return TIE, f"recorded margin {margin:.3g} <= tolerance {tol.margin:g}"
    return DIFFERS, f"recorded margin {margin:.3g} > tolerance {tol.margin:g}"


def action(recorded_hex: str, replayed_hex: str, tol: Tolerance) -> tuple[str, str, float]:
    """(portable outcome, detail, largest absolute difference) of an action vector (float32 hex)."""
    if recorded_hex == replayed_hex:
        return SAME, "", 0.0
    recorded, replayed = _floats(recorded_hex), _floats(replayed_hex)
    if recorded.shape != replayed.shape:
        return DIFFERS, f"{recorded.size} values recorded, {replayed.size} replayed", float("inf")
    gap = np.abs(recorded.astype(np.float64) - replayed.astype(np.float64))
    largest = float(gap.max()) if gap.size else 0.0
    bound = tol.action_atol + tol.action_rtol * np.abs(recorded.astype(np.float64))
    if np.isfinite(gap).all() and (gap <= bound).all():
        return WITHIN, f"largest difference {largest:.3g}", largest
    return DIFFERS, f"largest difference {largest:.3g} beyond atol {tol.action_atol:g} + rtol {tol.action_rtol:g}", \
        largest


def _floats(hexed: str) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(hexed), dtype="<f4")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def token_run(scored: list[tuple[int, float]], produced: list[int], tol: Tolerance = Tolerance()) -> tuple[str, str]:
    """(portable outcome, detail) of a run of tokens against a decode's scored ones (token,
    margin): judged at the first token that differs, since every token after it grows from
    another one. A run of another length DIFFERS."""
    if len(produced) != len(scored):
        return DIFFERS, f"{len(produced)} tokens against {len(scored)}"
    first = next((i for i, ((want, _), got) in enumerate(zip(scored, produced)) if want != got), None)
    if first is None:
        return SAME, ""
    outcome, detail = token(scored[first][0], scored[first][1], produced[first], tol)
    return outcome, f"the first of them differs at token {first}: {detail}"
