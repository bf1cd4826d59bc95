"""What the launch file's arguments become: the node's parameter list (pure Python, testable
without launch, which is not on PyPI)."""
from __future__ import annotations

from typing import Any

_BOOLS = {"true": True, "1": True, "false": False, "0": False}


def node_parameters(params_file: str, autostart: str) -> list[Any]:
    """The params file, then ``autostart`` only when the argument was given: left empty, the
    params file's own ``autostart`` (or the node's default, false) stands."""
    if autostart == "":
        return [params_file]
    value = _BOOLS.get(autostart.strip().lower())
    if value is None:
        raise ValueError(f"autostart:={autostart!r}: use true or false, or leave it out to keep the params file's")
    return [params_file, {"autostart": value}]
