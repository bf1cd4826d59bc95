"""Replay of a journal (``serving.journal``) on a fresh engine.

``judge`` applies the entries one after another and judges every output (tokens, actions,
positions, error codes, state digests) both ways, exact and portable (``verdicts``); ``replay``
demands the exact verdict. Capsule ids are random per process, so replay
maps recorded ids to the ones it creates. ROS-free: it needs only an engine.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol

from ..errors import FlashRTError, InvalidArgument
from ..serving.journal import DECODE, DROP, FORK, PREFILL, PULL, RESTORE, ROLLBACK, SNAPSHOT, SPILL, STEP, Entry
from ..serving.operations import Rules, operation_of
from . import verdicts
from .verdicts import DIFFERS, EXACT_ONLY, SAME, Finding, Tolerance, Verdicts


class ReplayMismatch(AssertionError):
    """A replayed output differs from the recorded one; the message names the entry."""

    def __init__(self, entry: Entry, what: str, recorded: Any, replayed: Any) -> None:
        super().__init__(f"message seq={entry.seq} ({entry.kind}): {what} was {_short(recorded)} when recorded, "
                         f"{_short(replayed)} on replay")
        self.entry, self.what = entry, what


def replay(entries: Iterable[Entry], engine: Any, fleet: Any = None) -> Verdicts:
    """Apply ``entries`` to ``engine`` in order; raise ReplayMismatch at the first output that is
    not byte-identical (the exact verdict, stopping early). ``fleet``: the fleet tier the
    journal's pulls take their capsules from again (see ``EngineTarget``)."""
    return judge(entries, engine, strict=True, fleet=fleet)


def judge(entries: Iterable[Entry], engine: Any, tolerance: Tolerance = Tolerance(),
          strict: bool = False, outputs: Mapping[str, tuple[str, ...]] | None = None, fleet: Any = None) -> Verdicts:
    """Apply ``entries`` to ``engine`` and judge every output both ways (see ``verdicts``).

    A token that differs is replaced by the recorded one (rollback of the step, then
    ``engine.append``), so the rest of the session is judged from the recorded history; a call
    whose outcome or position differs ends the replay there (``Verdicts.stopped``). ``strict``:
    raise ReplayMismatch at the first finding instead. Every entry is checked for what its kind
    must hold before the first is applied (``check_entries``): a malformed journal is refused
    as a whole, wherever a replay of its earlier entries would have diverged. ``outputs``: what
    each kind must have recorded (default: a journal's, ``JOURNAL_OUTPUTS``); an output an
    entry does not hold is not judged."""
    return judge_on(entries, EngineTarget(engine, fleet), tolerance, strict, outputs)


class Target(Protocol):
    """What entries are replayed on: this process's engine (``EngineTarget``), or a node over
    DDS (``ros.live_replay``). Capsule ids are mapped through ``ids`` (recorded -> replayed)."""

    def apply(self, entry: Entry, ids: dict[str, str]) -> dict[str, Any]:
        """The entry's call, made again: its outputs ("token", "action", "capsule_id", and the
        "position" it leaves); FlashRTError with its code when refused."""

    def state_digest(self) -> str | None:
        """The digest of the live state (None: the target cannot tell)."""

    def take_recorded(self, entry: Entry, token: int) -> None:
        """Replace the token ``entry`` just produced with the recorded ``token``."""


class EngineTarget:
    """Entries applied to an engine in this process, by the rules the session applied them by.
    ``fleet``: the fleet tier (``capsule.fleet.FleetTier``) a pull entry takes its capsule from
    again, by id; without one a journal that pulled stops there, refused."""

    def __init__(self, engine: Any, fleet: Any = None) -> None:
        self.engine = engine
        self._rules = Rules(fleet=fleet)

    def apply(self, entry: Entry, ids: dict[str, str]) -> dict[str, Any]:
        self._rules.ids = ids
        produced = dict(self._rules.apply(operation_of(entry.kind, entry.request), self.engine).outputs)
        produced["position"] = self.engine.position
        return produced

    def state_digest(self) -> str:
        return self.engine.state_digest()

    def take_recorded(self, entry: Entry, token: int) -> None:
        self.engine.rollback(steps=1)   # go on from the recorded token, as the recording did
        self.engine.append(token, seed=entry.request.get("seed"))


def judge_on(entries: Iterable[Entry], target: Target, tolerance: Tolerance = Tolerance(),
             strict: bool = False, outputs: Mapping[str, tuple[str, ...]] | None = None) -> Verdicts:
    """``judge``, on any ``Target``."""
    entries = list(entries)
    check_entries(entries, outputs)
    ids: dict[str, str] = {}
    report = Verdicts()

    def found(entry: Entry, what: str, recorded: Any, replayed: Any, portable: str, detail: str = "") -> Finding:
        if strict:
            raise ReplayMismatch(entry, what, recorded, replayed)
        report.findings.append(Finding(entry.seq, entry.kind, what, recorded, replayed, portable, detail))
        return report.findings[-1]

    for entry in entries:
        out = entry.outcome
        try:
            produced = target.apply(entry, ids)
            code = 0
        except FlashRTError as exc:
            produced, code = {}, int(exc.code)
        report.entries += 1
        if code != out["error_code"]:
            report.stopped = found(entry, "error_code", out["error_code"], code, DIFFERS)
            break
        if code:
            report.failures_reproduced += 1
            continue
        if entry.kind == DECODE:
            recorded, margin = out["token"], out.get("margin")
            portable, detail = verdicts.token(recorded, margin, produced["token"], tolerance)
            if portable != SAME:
                found(entry, "token", recorded, produced["token"], portable, detail)
                target.take_recorded(entry, recorded)
        if "position" in out and out["position"] != produced.get("position"):
            report.stopped = found(entry, "position", out["position"], produced.get("position"), DIFFERS)
            break
        if entry.kind == STEP:
            portable, detail, largest = verdicts.action(out["action"], produced["action"], tolerance)
            report.largest_action_difference = max(report.largest_action_difference, largest)
            if portable != SAME:
                found(entry, "action", out["action"], produced["action"], portable, detail)
        if entry.kind in (SNAPSHOT, FORK, PULL):
            ids[out["capsule_id"]] = produced["capsule_id"]
        if "state_digest" in out and out["state_digest"] != (digest := target.state_digest()):
            found(entry, "state_digest", out["state_digest"], digest, EXACT_ONLY)
        report.tokens += entry.kind == DECODE
        report.actions += entry.kind == STEP
        report.capsule_calls += entry.kind not in (PREFILL, DECODE, STEP, SPILL)
    return report


# What an entry of each kind must have recorded for its replay to be checked: "*" for every
# entry, the kind's own for a successful one.
JOURNAL_OUTPUTS: dict[str, tuple[str, ...]] = {
    "*": ("error_code", "position"), DECODE: ("token",), STEP: ("action",), SNAPSHOT: ("capsule_id", "state_digest"),
    FORK: ("capsule_id", "state_digest"), RESTORE: ("state_digest",), ROLLBACK: ("state_digest",),
    DROP: ("state_digest",), PULL: ("capsule_id",)}


# What the request of each kind must hold for it to be applied at all.
_REQUESTED = {PREFILL: ("token_ids",), STEP: ("observation",), SNAPSHOT: ("tier",), SPILL: ("spill",),
              RESTORE: ("capsule_id",), DROP: ("capsule_id",), PULL: ("capsule_id",)}


def check_entries(entries: Iterable[Entry], outputs: Mapping[str, tuple[str, ...]] | None = None) -> None:
    """InvalidArgument naming the first entry that lacks what its kind needs: a request field
    its call cannot do without, or an output it must have recorded (a journal missing one
    would replay as identical without checking it). Judged from the journal alone, before
    anything is replayed, so the verdict does not depend on the machine that replays it.
    ``outputs``: as for ``judge``."""
    outputs = JOURNAL_OUTPUTS if outputs is None else outputs
    for entry in entries:
        if not isinstance(entry.request, dict) or not isinstance(entry.outcome, dict):
            raise InvalidArgument(f"message seq={entry.seq} ({entry.kind}): request and outcome must be maps")
        code = entry.outcome.get("error_code")
        wanted = outputs["*"] + (outputs.get(entry.kind, ()) if code == 0 else ())
        missing = [key for key in wanted if key not in entry.outcome]
        if missing:
            raise InvalidArgument(f"message seq={entry.seq} ({entry.kind}) records no {', '.join(missing)}: "
                                  "a journal entry without its outputs cannot be checked")
        margin = entry.outcome.get("margin", 0.0)
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise InvalidArgument(f"message seq={entry.seq} ({entry.kind}) records margin {margin!r}, "
                                  "not a number >= 0")
        if code == 0 and entry.kind in (RESTORE, DROP) and not entry.request.get("capsule_id"):
            raise InvalidArgument(f"message seq={entry.seq} ({entry.kind}) succeeded without naming a capsule")
        absent = [key for key in _REQUESTED.get(entry.kind, ()) if key not in entry.request]
        if absent:
            raise InvalidArgument(f"message seq={entry.seq} ({entry.kind}) requests no {', '.join(absent)}: "
                                  "the call cannot be made again")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
