"""pip install -e . : the ROS-free layers (flashrt_ros.runtime, flashrt_ros.capsule, flashrt_ros.distill).

The ROS 2 package (interfaces, node) is built by colcon from package.xml and
CMakeLists.txt; colcon sees build type ament_cmake there and ignores this file.
The version is read from package.xml, so the two cannot drift apart.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).resolve().parent


def package_version() -> str:
    version = ET.parse(ROOT / "package.xml").getroot().findtext("version", "").strip()
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise ValueError(f"package.xml <version> must be X.Y.Z, got {version!r}")
    return version


def runtime_requirements() -> list[str]:
    """requirements/runtime.txt, with its tested pins as lower bounds: an exact torch pin
    would make pip replace a platform's own build (JetPack). Where no torch is installed,
    pip then takes the newest PyPI build, a CUDA one: the README says to install torch first."""
    reqs = []
    for line in (ROOT / "requirements" / "runtime.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(line.replace("==", ">=", 1))
    return reqs


# The CPU backend's small C library (few-row products, the Gated DeltaNet mixer, the load's
# transposing cast, the delta rule's gradients for training), loaded with
# ctypes (flashrt_ros/runtime/backends/cpu/library.py), so it is built like an extension but
# defines no Python module. Optional: without a C compiler the install still succeeds and torch
# does that work.
NATIVE = Extension("flashrt_ros._native",
                   sources=["src/row_product.c", "src/delta_step.c", "src/transpose_cast.c", "src/delta_train.c"],
                   depends=["src/fma_loops.h", "src/fp_mode.h"],
                   extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-fopenmp"],
                   extra_link_args=["-fopenmp"], libraries=["m"], optional=True)

setup(
    name="flashrt_ros",
    version=package_version(),
    description="Execution-state capsules for an on-device model (ROS-free layers)",
    python_requires=">=3.10",
    packages=find_packages(include=["flashrt_ros", "flashrt_ros.runtime*", "flashrt_ros.capsule*",
                                    "flashrt_ros.distill*"]),
    install_requires=runtime_requirements(),
    # The MTP head distiller needs only the runtime (train_lm, which trains a main model, also
    # transformers).
    entry_points={"console_scripts": ["flashrt-train-mtp = flashrt_ros.distill.train_mtp:main"]},
    ext_modules=[NATIVE],
)
