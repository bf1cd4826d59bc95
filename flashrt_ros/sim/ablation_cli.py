"""The command line the two ablations share: run N seeded episodes, print the table, draw it."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Callable


def main(argv: list[str] | None, prog: str, doc: str | None, policy: Path, seeds: range,
         run: Callable[[Path, range], Any], draw: Callable[[Any, Path], Path]) -> int:
    """``--policy`` (default ``policy``), ``--episodes`` (the first N of ``seeds``, all by
    default) and ``--out`` (where the figure goes): the ``table()`` of ``run(policy, seeds)``
    printed, and ``draw(result, out)`` written."""
    parser = argparse.ArgumentParser(prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", type=Path, default=policy)
    parser.add_argument("--episodes", type=int, default=len(seeds))
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be at least 1")
    result = run(args.policy, range(seeds.start, seeds.start + args.episodes))
    print(result.table())
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"wrote {draw(result, args.out)}")
    return 0
