"""flashrt-replay BAG: replay a recorded session on a fresh engine and judge every output.

Two verdicts, both reported per message that differs:
  exact     every output byte-identical (tokens, action bytes, positions, error codes, state
            digests after capsule calls): promised on the recording's platform only
  portable  tokens identical wherever the recorded margin of the choice exceeds --margin-tol
            (closer to a tie a differing token is a tie, and the replay goes on from the
            recorded one); actions within --action-atol + --action-rtol x |recorded|; every
            call with the recorded outcome, error code and position
--verdict auto (the default) applies exact on the recording's platform (the same device,
torch, CPU kernels, CPU and thread count) and portable elsewhere.

BAG is a journal bag (the node's journal_path), or a recording of the node's topics and
service events as `ros2 bag record` writes it (see replay.recording: the node must serve with
service_introspection=contents, and the recording needs the node's ~/session topic, or
--session naming a bag that holds it). A recording holds no state digests: its verdicts judge
actions, outcomes, error codes and the positions the services answered.

flashrt-replay --live BAG plays a recording's observations and capsule calls into a running
flashrt_node over DDS instead, and judges what it answers (flashrt_ros.ros.live_replay).

Exit status: 0 when the applied verdict passes; 1 when it fails, naming each message; 2 when
the bag cannot be read as a flashrt journal or its engine cannot be rebuilt.

Run as a program on x86, it re-executes itself once under the vector kernels the session was
recorded with (ATEN_CPU_CAPABILITY, which torch reads only when a process starts), unless that
variable is set already or the verdict asked for is portable. It only ever steps down (AVX-512
to AVX2): torch does not check the variable against the CPU, and kernels the CPU lacks would
crash it.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
from typing import Any
from pathlib import Path

import torch

from .bag import ENTRY_TOPIC, is_journal_bag, read_bag
from ..capsule import signing
from ..errors import InvalidArgument
from ..serving.journal import Journal
from ..serving.record import SessionRecord
from .journal import JOURNAL_OUTPUTS, check_entries, judge
from .recording import RECORDED_OUTPUTS, Recording, find_session, read_recording
from .salvage import complete_bag
from .session import engine_for, platform_differences, platform_of
from .verdicts import DIFFERS, Tolerance, Verdicts

CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
# torch's x86 kernel levels, lowest first.
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")
_SHOWN = 20   # findings printed; --report lists them all


def main(argv: list[str] | None = None, rerun: bool = False) -> int:
    """``rerun``: allowed to re-execute this process at the recorded kernels. Only the
    command itself passes it: a re-exec restarts whatever program the process runs."""
    args = parser().parse_args(argv)
    try:
        tolerance = Tolerance(args.margin_tol, args.action_atol, args.action_rtol)
        journal, outputs, source, salvaged = read(args.bag, args.session)
        try:
            check_entries(journal.entries, outputs)
        except InvalidArgument as exc:
            raise InvalidArgument(f"malformed entry: {exc}") from None
        capability = journal.session.aten_cpu_capability
        if rerun and args.verdict != "portable":
            _rerun_at(capability)
        if salvaged:   # after the restart, which reads the bag again: said once
            print(f"flashrt-replay: {args.bag}: {salvaged}", file=sys.stderr)
        threads = journal.session.torch_threads
        if threads < 1:
            raise ValueError(f"the session records torch_threads={threads!r}, not an int >= 1")
        torch.set_num_threads(threads)   # see session_of: the split of elementwise work must be the recorded one
        key = signing.load_key(args.capsule_key_file) if args.capsule_key_file else None
        fleet = fleet_of(args, key)
        engine = engine_for(journal.session, args.device, args.capsule_dir, key, strict=args.verdict == "exact",
                            mtp_head=args.mtp_head)
    except Exception as exc:   # rosbags' ReaderError and SerdeError included: a bag it cannot read
        print(f"flashrt-replay: cannot replay {args.bag}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    session = journal.session
    here = platform_of(engine)
    differences = platform_differences(session, here)
    verdict = args.verdict if args.verdict != "auto" else ("portable" if differences else "exact")
    print(f"replaying {len(journal.entries)} operations from {args.bag}, {source} "
          f"({session.model_path or 'embedded default'}, model {session.model_fingerprint[:12]})")
    print("platform: the recording's" if not differences else "platform differs: " + "; ".join(differences))
    try:
        report = judge(journal.entries, engine, tolerance, outputs=outputs, fleet=fleet)
        digest = engine.state_digest()
    except (KeyError, TypeError, ValueError, AttributeError) as exc:   # an entry missing what its kind needs
        print(f"flashrt-replay: cannot replay {args.bag}: malformed entry ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    finally:
        # Stop the digest thread before the interpreter exits. A mismatch right after a
        # snapshot can leave it hashing inside torch, and a daemon thread killed there at
        # exit aborts the process.
        engine.close()
    if args.report:
        write_report(Path(args.report), journal.entries, report)
    print_verdicts(report, tolerance, verdict, session, here, ENTRY_TOPIC if outputs is JOURNAL_OUTPUTS else "operation")
    if report.stopped is None:
        print(f"final state digest {digest}")
    return 0 if report.passes(verdict) else 1


def fleet_of(args: argparse.Namespace, key: bytes | None) -> Any:
    """The fleet tier the arguments name (None: none)."""
    if not args.fleet_url:
        return None
    from ..capsule.fleet import FleetTier   # with its client library, only where a fleet is named
    return FleetTier(args.fleet_url, key, args.fleet_prefix, password_file=args.fleet_password_file,
                     node="flashrt-replay")


def parser(prog: str = "flashrt-replay", description: str | None = __doc__,
           in_process: bool = True) -> argparse.ArgumentParser:
    """The command's arguments; ``in_process``: with those of a replay on an engine of its own."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bag", help="rosbag2 folder: a journal bag written by flashrt_node's journal_path, or a "
                        "recording (ros2 bag record) of its topics and service events")
    parser.add_argument("--session", help="a bag holding the node's session record (flashrt_ros/msg/JournalSession, "
                        "which the node publishes on ~/session), for a recording that lacks it")
    if in_process:
        parser.add_argument("--device", default="cpu", help="torch device of the fresh engine (default cpu)")
        parser.add_argument("--capsule-dir", help="where the disk capsules the session started with are now "
                            "(default: the capsule_dir it recorded); they are copied, never changed")
        parser.add_argument("--capsule-key-file", help="the key file of a session that signed its capsule files")
        parser.add_argument("--mtp-head", help="the MTP head file of a session whose node served with mtp_head "
                            "(not recorded; its weights are in the recorded fingerprint)")
        parser.add_argument("--fleet-url", help="the fleet tier (redis:// or rediss:// URL) that a session which "
                            "pulled capsules pulled them from: they are pulled again, by id, and checked; its "
                            "capsules are signed with --capsule-key-file")
        parser.add_argument("--fleet-prefix", default="flashrt", help="its key prefix (default flashrt)")
        parser.add_argument("--fleet-password-file", default="", help="a file with its password")
    parser.add_argument("--verdict", choices=("auto", "exact", "portable"), default="auto",
                        help="the verdict that decides the exit status (default auto: exact on the recording's "
                        "platform, portable elsewhere)")
    defaults = Tolerance()
    parser.add_argument("--margin-tol", type=float, default=defaults.margin,
                        help=f"logits: a token chosen closer than this to a tie may differ (default {defaults.margin:g})")
    parser.add_argument("--action-atol", type=float, default=defaults.action_atol,
                        help=f"absolute action tolerance (default {defaults.action_atol:g})")
    parser.add_argument("--action-rtol", type=float, default=defaults.action_rtol,
                        help=f"relative action tolerance (default {defaults.action_rtol:g})")
    parser.add_argument("--report", help="write both verdicts for every message to this file (tab-separated)")
    return parser


def read(bag: str, session_bag: str | None) -> tuple[Journal, dict, str, str]:
    """The journal of a journal bag, or of a rosbag2 recording of the node's topics (with the
    session record from ``session_bag`` if the recording lacks one), what its entries hold,
    what the bag is, in words, and what was left out of a bag its recorder left unfinished
    (killed), which is read up to its last complete message ('' for a whole bag)."""
    with complete_bag(bag) as (path, salvaged):
        ends = salvaged.describe() if salvaged is not None else ""
        if is_journal_bag(path):
            return read_bag(path), JOURNAL_OUTPUTS, "a journal bag", ends
        recording = read_recorded(str(path), session_bag)
    words = (f"a rosbag2 recording of node {recording.journal.session.node} ({recording.dropped_observations} "
             f"observations with no action and {recording.skipped_calls} calls that reached no engine left out"
             + "".join(f"; {note}" for note in recording.notes) + "; no state digests recorded)")
    return recording.journal, RECORDED_OUTPUTS, words, ends


def read_recorded(bag: str, session_bag: str | None) -> Recording:
    """The recording in ``bag``, its session record taken from ``session_bag`` when it lacks one."""
    session = None
    if session_bag:
        with complete_bag(session_bag) as (path, _):
            session = find_session(path)
        if session is None:
            raise InvalidArgument(f"--session {session_bag}: no flashrt_ros/msg/JournalSession in it")
    return read_recording(bag, session)


def print_verdicts(report: Verdicts, tolerance: Tolerance, verdict: str, session: SessionRecord, here: dict,
                   where: str) -> None:
    messages = report.messages()
    out = sys.stdout if report.passes(verdict) else sys.stderr
    for finding in report.findings[:_SHOWN]:
        print(("MISMATCH " if verdict == "exact" or finding.portable == DIFFERS else "") +
              f"in {where}, message {finding.line()}", file=out)
    if len(report.findings) > _SHOWN:
        print(f"... and {len(report.findings) - _SHOWN} more (--report FILE lists every message)", file=out)
    if report.stopped is not None:
        print(f"stopped at seq={report.stopped.seq}: a call with another outcome or position, from which the "
              f"session cannot be judged further", file=out)
    counts = (f"{report.entries} operations, {report.tokens} tokens, {report.actions} actions, "
              f"{report.capsule_calls} capsule calls, {report.failures_reproduced} refusals")
    print(f"exact:    {'identical' if report.exact else 'differs'}: {counts}"
          + ("" if report.exact else f"; {len(messages)} messages differ"), file=out)
    failing = sum(p == "fail" for _, p in messages.values())
    print(f"portable: {'pass' if report.portable else 'fail'}: {report.ties} ties within margin "
          f"{tolerance.margin:g}, largest action difference {report.largest_action_difference:.3g} "
          f"(atol {tolerance.action_atol:g}, rtol {tolerance.action_rtol:g})"
          + (f"; {failing} messages fail" if failing else ""), file=out)
    print(f"verdict applied: {verdict}", file=out)
    if not report.exact:
        print(f"(recorded with torch {session.torch or 'unknown'} on "
              f"{session.aten_cpu_capability or 'unrecorded'} kernels of {session.cpu or 'an unrecorded CPU'}, "
              f"replayed with {here['torch']} on {here['aten_cpu_capability']} kernels of "
              f"{here['cpu']}: replay is byte-exact on the same torch, CPU kernels and flashrt_ros build only, and "
              "MKL's products may round differently on another CPU vendor)", file=out)


def write_report(path: Path, entries: list, report: Verdicts) -> None:
    messages = report.messages()
    by_seq: dict[int, list[str]] = {}
    for finding in report.findings:
        by_seq.setdefault(finding.seq, []).append(f"{finding.what} {finding.portable}"
                                                  + (f" ({finding.detail})" if finding.detail else ""))
    judged = report.entries
    with path.open("w") as f:
        f.write("seq\tkind\texact\tportable\tdetail\n")
        for entry in entries:
            if entry.seq >= judged:
                exact, portable = "not judged", "not judged"
            else:
                exact, portable = messages.get(entry.seq, ("identical", "pass"))
            f.write(f"{entry.seq}\t{entry.kind}\t{exact}\t{portable}\t{'; '.join(by_seq.get(entry.seq, []))}\n")


def _rerun_at(wanted: str | None) -> None:
    """Replace this process by itself at the recorded kernel level, when that is below ours."""
    current = torch.backends.cpu.get_cpu_capability()
    if (os.name != "posix" or platform.machine().lower() not in ("x86_64", "amd64") or CAPABILITY_ENV in os.environ
            or wanted not in X86_CAPABILITIES or current not in X86_CAPABILITIES
            or X86_CAPABILITIES.index(wanted) >= X86_CAPABILITIES.index(current)):
        return
    sys.stdout.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                  {**os.environ, CAPABILITY_ENV: wanted.lower()})
    except OSError as exc:   # replay here all the same: a mismatch will name both levels
        print(f"flashrt-replay: cannot restart at {wanted} kernels ({exc}); replaying at {current}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(rerun=True))
