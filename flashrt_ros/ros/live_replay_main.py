"""flashrt-replay --live BAG: play a recording into the running flashrt_node it recorded, over
DDS, and judge what the node answers, with the verdicts and exit status of flashrt-replay.

BAG is a recording of the node's topics and service events (as ``ros2 bag record`` writes it,
with service_introspection=contents) or the node's own journal bag, which holds the same
topics; a journal bag with Generate goals or spill changes is refused, since those are not
played (replay it in-process). The node is found by the name its session record gives, in this
process's ROS domain; see ``live_replay`` for what it must start from.

--verdict auto applies exact when the live node's session record states the recording's
platform, portable otherwise. Exit status: 0 the verdict passes, 1 it fails, 2 the bag cannot
be played (unreadable, foreign, or the node is not there, not the recorded model, or not
started as the recorded one was).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import InvalidArgument
from ..replay.bag import is_journal_bag, read_bag
from ..replay.cli import parser, print_verdicts, read_recorded, write_report
from ..replay.journal import check_entries, judge_on
from ..replay.recording import RECORDED_OUTPUTS
from ..replay.salvage import complete_bag
from ..replay.session import platform_differences, platform_in
from ..replay.verdicts import Tolerance
from ..serving.journal import STEP
from ..serving.record import SessionRecord
from .live_replay import PLAYED_CALLS, LiveNode, Unanswered

_PLAYED = {STEP, *PLAYED_CALLS}


def _read(args: argparse.Namespace) -> Any:
    """The recording to play (``replay.cli.read_recorded``), its calls checked."""
    if args.timeout <= 0 or args.settle_ms < 0:
        raise InvalidArgument("--timeout must be > 0 and --settle-ms >= 0")
    with complete_bag(args.bag) as (bag, salvaged):
        if salvaged is not None:
            print(f"flashrt-replay --live: {args.bag}: {salvaged.describe()}", file=sys.stderr)
        if is_journal_bag(bag):
            entries = read_bag(bag).entries
            unplayed = sorted({e.kind for e in entries} - _PLAYED)
            if unplayed:
                raise InvalidArgument(f"the journal holds {', '.join(unplayed)} operations, which a live replay "
                                      "does not play: replay it in-process (without --live)")
            # Played into a node, a fleet snapshot would publish to the fleet again (and move its name).
            if any(e.request.get("requested_tier") == "fleet" for e in entries):
                raise InvalidArgument("the journal holds snapshots published to the fleet tier, which a live "
                                      "replay would publish again: replay it in-process (without --live)")
        recording = read_recorded(str(bag), args.session)
    check_entries(recording.journal.entries, RECORDED_OUTPUTS)
    return recording


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        tolerance = Tolerance(args.margin_tol, args.action_atol, args.action_rtol)
        recording = _read(args)
        journal = recording.journal
    except Exception as exc:   # rosbags' ReaderError and SerdeError included: a bag it cannot read
        print(f"flashrt-replay --live: cannot replay {args.bag}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    recorded = journal.session
    try:
        node = LiveNode(recorded, recording.inputs, args.timeout, args.settle_ms / 1000)
    except Exception as exc:   # rclpy refusing a topic name from the record, say
        print(f"flashrt-replay --live: cannot play into {recorded.node}: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        return 2
    try:
        try:
            live = node.connect()
            _check_start(recorded, live)
        except InvalidArgument as exc:
            print(f"flashrt-replay --live: cannot replay {args.bag} into {recorded.node}: {exc}", file=sys.stderr)
            return 2
        here = platform_in(live)
        differences = platform_differences(recorded, here)
        verdict = args.verdict if args.verdict != "auto" else ("portable" if differences else "exact")
        print(f"playing {len(journal.entries)} operations from {args.bag} into the live node {recorded.node} "
              f"({recording.dropped_observations} observations with no action and {recording.skipped_calls} calls "
              f"that reached no engine left out" + "".join(f"; {note}" for note in recording.notes) + ")")
        print("platform: the recording's" if not differences else "platform differs: " + "; ".join(differences))
        try:
            report = judge_on(journal.entries, node, tolerance, outputs=RECORDED_OUTPUTS)
        except Unanswered as exc:   # the node behaved otherwise: it did not answer at all
            print(f"MISMATCH: the live node gave no answer: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:   # Unplayable, or the middleware failing under the player
            print(f"flashrt-replay --live: cannot go on playing {args.bag}: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            return 2
    finally:
        node.close()
    if args.report:
        write_report(Path(args.report), journal.entries, report)
    print_verdicts(report, tolerance, verdict, recorded, here, "operation")
    return 0 if report.passes(verdict) else 1


def _parser() -> argparse.ArgumentParser:
    p = parser("flashrt-replay --live", __doc__, in_process=False)
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds to wait for the node to come up, and for each of its answers (default 30)")
    p.add_argument("--settle-ms", type=float, default=20.0,
                   help="milliseconds between a step's pose, once the node acknowledged it, and its joint state "
                   "(default 20): the node pairs a joint state with the latest pose it took")
    return p


def _check_start(recorded: SessionRecord, live: SessionRecord) -> None:
    """InvalidArgument when the live node does not serve what the recorded one served, from
    the state it started in."""
    for key in ("model_fingerprint", "layout_fingerprint"):
        if getattr(live, key) != getattr(recorded, key):
            raise InvalidArgument(f"its {key} {getattr(live, key)[:12]} is not the recorded "
                                  f"{getattr(recorded, key)[:12]}: another model or layout")
    for key in ("joint_names", "joint_states_topic", "ee_pose_topic", "action_topic", "default_tier"):
        if getattr(live, key) != getattr(recorded, key):
            raise InvalidArgument(f"it serves {key}={getattr(live, key)!r}, the recorded node "
                                  f"{getattr(recorded, key)!r}")
    found, wanted = dict(live.preloaded), dict(recorded.preloaded)
    if found != wanted:
        raise InvalidArgument(f"it started with disk capsules {sorted(found)}, the recorded one with {sorted(wanted)}")


if __name__ == "__main__":
    sys.exit(main())
