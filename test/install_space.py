"""Where colcon installed this package: the prefix the sourced environment names (a ROS
workspace's install/, wherever it is), else this checkout's install/ (``make setup``)."""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _prefix() -> Path:
    for entry in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if entry and (Path(entry) / "share" / "ament_index" / "resource_index" / "packages" / "flashrt_ros").exists():
            return Path(entry)
    return ROOT / "install" / "flashrt_ros"


PREFIX = _prefix()
EXECUTABLES = PREFIX / "lib" / "flashrt_ros"
