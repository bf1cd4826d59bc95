"""Byte-compile the third-party modules this project imports, and no others.

Run by `make setup` after a locked install, which passes pip --no-compile:
compiling every file of ~200 packages (most of torch, sympy and transformers
are never imported here) costs about 50 s of CPU, while importing what the
project uses writes the .pyc files that matter in a few seconds. Without them
each process would compile those modules again wherever
PYTHONDONTWRITEBYTECODE is set, so this script turns bytecode writing back on
for itself.

The modules come from the import statements of flashrt_ros/ and test/, so the
list keeps itself current. The project's own modules are left out: colcon has
not installed them yet when this runs, and they are few.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("flashrt_ros", "test")


def third_party_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """Absolute imports of non-stdlib, non-local modules: module -> names taken from it."""
    local = {"flashrt_ros", "__future__"} | {p.stem for p in (root / "test").glob("*.py")}
    found: dict[str, set[str]] = {}
    for folder in SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    pairs = [(alias.name, None) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    pairs = [(node.module, alias.name) for alias in node.names]
                else:
                    continue
                for module, name in pairs:
                    top = module.split(".", 1)[0]
                    if top in local or top in sys.stdlib_module_names:
                        continue
                    names = found.setdefault(module, set())
                    if name is not None:
                        names.add(name)
    return found


def main() -> int:
    sys.dont_write_bytecode = False
    failed = []
    for module, names in sorted(third_party_imports().items()):
        try:
            imported = importlib.import_module(module)
            # Lazy packages (transformers) load a submodule on attribute access.
            for name in sorted(names):
                getattr(imported, name, None)
        except Exception as exc:  # noqa: BLE001 - a warm-up must not fail setup
            failed.append(f"{module}: {exc}")
    for line in failed:
        print(f"warm_bytecode: could not import {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
