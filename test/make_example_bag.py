"""Record the committed example bag: python test/make_example_bag.py (under `make test`'s environment).

Runs the "attempt with rollback" tree against a node that journals into a
temporary folder, then moves the bag to data/bags/attempt_with_rollback (installed
to share/flashrt_ros/data: make demo replays its policy steps).

On x86 it records at torch's AVX2 kernels, which every x86 machine the tests run
on has: flashrt-replay re-executes itself at the recorded kernels, and it can
step an AVX-512 machine down to AVX2, never an AVX2 machine up.
"""
from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "OFF")
if platform.machine().lower() in ("x86_64", "amd64"):
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")   # before anything imports torch; oneDNN follows


def record(folder: Path, trees=("attempt-with-rollback",)) -> Path:
    """Run ``trees`` against a journaling node; return the bag it wrote under ``folder``."""
    import rclpy
    from rclpy.context import Context

    from flashrt_ros.bt.examples import TREES, run_tree
    from ros_harness import Harness
    import py_trees

    context = Context()
    rclpy.init(context=context)
    h = Harness(context, {"journal_path": str(folder)})
    try:
        for name in trees:
            py_trees.blackboard.Blackboard.clear()
            status = run_tree(TREES[name](h.client), period_s=0.005, timeout_s=60)
            if status.value != "SUCCESS":
                raise RuntimeError(f"{name} ended {status}")
        h.node.trigger_deactivate()
        h.node.trigger_cleanup()  # closes the bag
    finally:
        h.close()
        context.try_shutdown()
    (bag,) = [p for p in folder.iterdir() if p.is_dir()]
    return bag


if __name__ == "__main__":
    target = HERE.parent / "data" / "bags" / "attempt_with_rollback"
    with tempfile.TemporaryDirectory() as tmp:
        bag = record(Path(tmp))
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(exist_ok=True)
        shutil.copytree(bag, target)
    print(f"wrote {target} ({sum(f.stat().st_size for f in target.iterdir())} bytes)")
