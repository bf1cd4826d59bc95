"""The package's files that are not Python (interfaces, data, config), wherever it runs from."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = "flashrt_ros"


def package_file(relative: str) -> Path:
    """``relative`` (a path from the source tree's root, such as ``data/sim/reach_arm.xml``) in
    the source tree (also behind a symlink install), else in share/flashrt_ros of a prefix on
    AMENT_PREFIX_PATH (an install without the sources); FileNotFoundError naming both."""
    source = Path(__file__).resolve().parents[1] / relative
    found = source if source.exists() else share_file(PACKAGE, relative)
    if found is None:
        raise FileNotFoundError(f"{relative} is in neither the source tree nor share/{PACKAGE} of a prefix on "
                                "AMENT_PREFIX_PATH: source the install space")
    return found


def share_file(package: str, relative: str) -> Path | None:
    """``share/<package>/<relative>`` of the first prefix on AMENT_PREFIX_PATH that has it."""
    for prefix in filter(None, os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep)):
        path = Path(prefix) / "share" / package / relative
        if path.exists():
            return path
    return None
