"""What a capsule is, seen from outside: immutable metadata.

The bytes live in a tier (see ``store``); this record is what lists, events
and services show, and what a restore checks before it copies anything.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Protocol

from ..errors import shown
from .errors import FingerprintMismatch, InvalidCapsuleRequest

TIERS = ("device", "host", "disk")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
_ID = re.compile(r"[0-9a-f]{16}")   # 64 random bits in hex, as the store makes ids


class RegionLike(Protocol):
    """The arena region fields a capsule needs (``runtime.arena.Region`` has them)."""

    name: str
    group: str
    offset: int
    nbytes: int
    per_token: bool

    @property
    def row_bytes(self) -> int: ...

    def live_bytes(self, position: int) -> int: ...


class CapsuleInfo(NamedTuple):
    """Immutable; ``info._replace(field=value)`` makes a changed copy. A named tuple, not a
    frozen dataclass: every snapshot builds one on its latency-critical path, and a named
    tuple is built in C where a frozen dataclass runs a Python ``__init__`` with one
    ``object.__setattr__`` per field."""

    id: str
    name: str
    parent: str
    position: int
    # Bytes this capsule added to its tier when made (shared prefixes are counted once, by the
    # capsule that copied them, and stay counted while any capsule uses them): the tier's
    # used_bytes is not the sum of these once a capsule others share with is dropped.
    nbytes: int
    tier: str
    pinned: bool
    created: float              # seconds since the epoch
    model_fingerprint: str
    layout_fingerprint: str
    digest: str                 # blake2b of the live bytes; "" while it is still being computed
    history_hash: str           # blake2b of the token and observation history; "" while pending
    region_table: tuple[dict, ...]


def check_name(name: str | None) -> str:
    """Names are labels, never paths: letters, digits, '_', '.', '-', at most 128, no '..', and never
    the form of a capsule id (16 hex digits)."""
    if name is None or name == "":
        return ""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise InvalidCapsuleRequest(
            f"invalid capsule name {shown(name)}: use 1-128 of [A-Za-z0-9_.-], starting with a letter or digit, "
            "no '..'")
    if _ID.fullmatch(name):   # lookups try ids first: such a name could reach another capsule
        raise InvalidCapsuleRequest(f"invalid capsule name {name!r}: 16 hex digits is the form of a capsule id")
    return name


def is_capsule_id(text: str) -> bool:
    return isinstance(text, str) and _ID.fullmatch(text) is not None


def check_budgets(budgets: dict[str, int]) -> dict[str, int]:
    """A copy of ``budgets`` (bytes per tier), each a known tier with an int >= 0."""
    unknown = sorted(set(budgets) - set(TIERS), key=repr)
    if unknown:
        raise InvalidCapsuleRequest(f"budgets name unknown tiers {unknown}; tiers are {', '.join(TIERS)}")
    for tier, value in budgets.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidCapsuleRequest(f"budget for {tier} must be an int >= 0, got {value!r}")
    return dict(budgets)


def check_tier(tier: str) -> str:
    if tier not in TIERS:
        raise InvalidCapsuleRequest(f"unknown tier {shown(tier)}; tiers are {', '.join(TIERS)}")
    return tier


def check_compatible(info: CapsuleInfo, model_fingerprint: str, layout_fingerprint: str) -> None:
    """FingerprintMismatch unless the capsule was taken from this model and arena layout."""
    if info.model_fingerprint != model_fingerprint:
        raise FingerprintMismatch(
            f"capsule {info.id} was taken from model {info.model_fingerprint}, this engine runs {model_fingerprint}")
    if info.layout_fingerprint != layout_fingerprint:
        raise FingerprintMismatch(
            f"capsule {info.id} has arena layout {info.layout_fingerprint}, this engine has "
            f"{layout_fingerprint} (other max_seq_len, dtype or model shape)")
