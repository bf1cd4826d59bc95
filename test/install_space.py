"""Where colcon installed this package: the prefix the sourced environment names (a ROS
workspace's install/, wherever it is), else this checkout's install/ (``make setup``)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]


def _prefix() -> Path:
    for entry in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if entry and (Path(entry) / "share" / "ament_index" / "resource_index" / "packages" / "flashrt_ros").exists():
            return Path(entry)
    return ROOT / "install" / "flashrt_ros"


PREFIX = _prefix()
EXECUTABLES = PREFIX / "lib" / "flashrt_ros"


def start_node(log: IO[str], *params: str) -> subprocess.Popen:
    """The installed flashrt_node in a process of its own, with config/flashrt.yaml, autostart
    and ``params`` (``name:=value``), its output to ``log``."""
    args = [str(EXECUTABLES / "flashrt_node"), "--ros-args", "--params-file", str(ROOT / "config" / "flashrt.yaml"),
            "-p", "autostart:=true"]
    for param in params:
        args += ["-p", param]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
