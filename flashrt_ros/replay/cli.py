"""flashrt-replay BAG: replay a recorded session on a fresh engine and check every output.

Exit status: 0 when every output is identical (tokens, action bytes, positions,
error codes, state digests after capsule calls); 1 at the first mismatch,
which is named; 2 when the bag cannot be read as a flashrt journal.

Run as a program on x86, it re-executes itself once under the vector kernels
the session was recorded with (ATEN_CPU_CAPABILITY, which torch reads only
when a process starts), unless that variable is set already. It only ever
steps down (AVX-512 to AVX2): torch does not check the variable against the
CPU, and kernels the CPU lacks would crash it.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

from .bag import ENTRY_TOPIC, read_bag
from ..capsule import signing
from ..errors import InvalidArgument
from .journal import ReplayMismatch, check_entries, replay
from .session import cpu_name, engine_for

CAPABILITY_ENV = "ATEN_CPU_CAPABILITY"
# torch's x86 kernel levels, lowest first.
X86_CAPABILITIES = ("DEFAULT", "AVX2", "AVX512")


def main(argv: list[str] | None = None, rerun: bool = False) -> int:
    """``rerun``: allowed to re-execute this process at the recorded kernels. Only the
    command itself passes it: a re-exec restarts whatever program the process runs."""
    parser = argparse.ArgumentParser(prog="flashrt-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bag", help="rosbag2 folder (MCAP) written by flashrt_node's journal_path")
    parser.add_argument("--device", default="cpu", help="torch device of the fresh engine (default cpu)")
    parser.add_argument("--capsule-dir", help="where the disk capsules the session started with are now "
                        "(default: the capsule_dir it recorded); they are copied, never changed")
    parser.add_argument("--capsule-key-file", help="the key file of a session that signed its capsule files")
    args = parser.parse_args(argv)
    try:
        journal = read_bag(args.bag)
        try:
            check_entries(journal.entries)
        except InvalidArgument as exc:
            raise InvalidArgument(f"malformed entry: {exc}") from None
        capability = journal.session.get("aten_cpu_capability")
        if capability is not None and not isinstance(capability, str):
            raise ValueError(f"the session records aten_cpu_capability={capability!r}, not a name")
        if rerun:
            _rerun_at(capability)
        threads = journal.session.get("torch_threads")
        if threads is not None:   # see session_of: the split of elementwise work must be the recorded one
            if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
                raise ValueError(f"the session records torch_threads={threads!r}, not an int >= 1")
            torch.set_num_threads(threads)
        key = signing.load_key(args.capsule_key_file) if args.capsule_key_file else None
        engine = engine_for(journal.session, args.device, args.capsule_dir, key)
    except Exception as exc:   # rosbags' ReaderError and SerdeError included: a bag it cannot read
        print(f"flashrt-replay: cannot replay {args.bag}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    session = journal.session
    print(f"replaying {len(journal.entries)} operations from {args.bag} "
          f"({session['model_path'] or 'embedded default'}, model {session['model_fingerprint'][:12]})")
    try:
        report = replay(journal.entries, engine)
        digest = engine.state_digest()
    except ReplayMismatch as exc:
        print(f"MISMATCH in {ENTRY_TOPIC}, {exc}", file=sys.stderr)
        print(f"(recorded with torch {session.get('torch', 'unknown')} on "
              f"{session.get('aten_cpu_capability', 'unrecorded')} kernels of {session.get('cpu', 'an unrecorded CPU')}, "
              f"replayed with {torch.__version__} on {torch.backends.cpu.get_cpu_capability()} kernels of "
              f"{cpu_name()}: replay is byte-exact on the same torch, "
              "CPU kernels and flashrt_ros build only, and MKL's products may round differently on another "
              "CPU vendor)", file=sys.stderr)
        return 1
    except (KeyError, TypeError, ValueError, AttributeError) as exc:   # an entry missing what its kind needs
        print(f"flashrt-replay: cannot replay {args.bag}: malformed entry ({type(exc).__name__}: {exc})",
              file=sys.stderr)
        return 2
    finally:
        # Stop the digest thread before the interpreter exits. A mismatch right after a
        # snapshot can leave it hashing inside torch, and a daemon thread killed there at
        # exit aborts the process: once in CI, exit -6 instead of 1 (not reproduced in 140
        # runs here).
        engine.close()
    print(f"identical: {report.entries} operations, {report.tokens} tokens, {report.actions} actions "
          f"(byte for byte), {report.capsule_calls} capsule calls with their state digests, "
          f"{report.failures_reproduced} refusals with the same error codes")
    print(f"final state digest {digest}")
    return 0


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
