"""make demo, last part: the trained reaching policy in the simulation, closed loop over ROS.

1. The ablation, in this process: N jammed episodes, each retried from a full restore, a
   KV-only restore, a reset state and no rollback (``sim.ablation``); the success table, and
   retry_paths.png.
2. The behaviour tree of ``bt.reach`` against flashrt_sim (lockstep) and flashrt_node (the
   trained policy, journaling) in processes of their own: the jammed attempt misses, the
   retry from the restored snapshot reaches. The node's journal bag is replayed
   (flashrt-replay), exact on this machine.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..resources import package_file
from ..sim import ablation
from ..sim.train_policy import DEFAULT_OUT

WIRING = ["-r", "joint_states:=/flashrt/joint_states", "-r", "ee_pose:=/flashrt/ee_pose",
          "-r", "joint_trajectory:=/flashrt/joint_trajectory"]


@dataclass
class OverRos:
    status: str = "not run"
    attempts: list[tuple[str, bool, float]] = field(default_factory=list)
    bag: Path | None = None
    period_ms: tuple[float, float] | None = None   # wall time between control periods: median, p99
    replay_exit: int | None = None
    replay_tail: str = ""


def over_ros(out: Path, seed: int = ablation.ABLATION_SEEDS.start, policy: Path = DEFAULT_OUT) -> OverRos:
    """Part 2 (see the module docstring); the caller sets the ROS domain."""
    import rclpy
    from rclpy.context import Context

    result = OverRos()
    journals = out / "reach_journal"
    env = dict(os.environ)
    procs: list[subprocess.Popen] = []
    context = Context()
    with open(out / "reach_nodes.log", "w") as logs:
        try:
            procs += start_pair(logs, env, [f"seed:={seed}"], policy, journals)
            rclpy.init(context=context)
            _drive(context, result)
        finally:
            context.try_shutdown()
            stop_processes(procs)
    bags = sorted(journals.glob("session-*"))
    if bags:
        result.bag = bags[-1]
        done = subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", str(result.bag)], capture_output=True,
                              text=True, env=env, timeout=300)
        result.replay_exit, result.replay_tail = done.returncode, (done.stdout + done.stderr)[-1500:]
    return result


def _drive(context, result: OverRos) -> None:
    """The tree, from a client node of its own in ``context``."""
    import rclpy

    from ..bt.reach import reach_with_retry, run
    from ..ros.spinning import spun

    client = rclpy.create_node("reach_demo", context=context)
    root, world, attempts = reach_with_retry(client)
    with spun(client):
        wait_for_policy(client)
        result.status = run(root, timeout_s=120.0).name
        tip = root.tip()
        if result.status != "SUCCESS" and tip is not None:
            result.status += f" at {tip.name!r}" + (f": {tip.feedback_message}" if tip.feedback_message else "")
        result.attempts = [(a.name, reached, gap) for a in attempts for reached, gap in a.outcomes]
        gaps = np.diff(world.period_at) * 1e3
        if gaps.size:
            result.period_ms = (float(np.percentile(gaps, 50)), float(np.percentile(gaps, 99)))


def start_pair(logs: Any, env: dict, sim_params: list[str], policy: Path, journals: Path) -> list[subprocess.Popen]:
    """flashrt_sim in lockstep (with ``sim_params``, ``name:=value``) and flashrt_node with the
    policy at ``policy``, journaling into ``journals``, each a process of its own, wired together."""
    sim = [sys.executable, "-m", "flashrt_ros.ros.sim_node", "--ros-args", "-p", "lockstep:=true"]
    for param in sim_params:
        sim += ["-p", param]
    node = [sys.executable, "-m", "flashrt_ros.ros.main", "--ros-args", "--params-file",
            str(package_file("config/reach_sim.yaml")), "-p", f"model_path:={policy}",
            "-p", f"journal_path:={journals}", "--log-level", "warn"]
    return [subprocess.Popen(args, stdout=logs, stderr=subprocess.STDOUT, env=env) for args in (sim + WIRING, node)]


def stop_processes(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_policy(client, timeout_s: float = 120.0) -> None:
    """Until the policy node serves (its capsule services answer as active)."""
    from ..srv import ListCapsules

    service = client.create_client(ListCapsules, "/flashrt/list_capsules")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.wait_for_service(timeout_sec=1.0):
            future = service.call_async(ListCapsules.Request())
            end = time.monotonic() + 10
            while not future.done() and time.monotonic() < end:
                time.sleep(0.01)
            if future.done() and future.result().success:
                return
        time.sleep(0.2)
    raise TimeoutError("flashrt_node with the reaching policy did not come up")


def run_scenario(out: Path) -> bool:
    """Both parts, printed; whether they did what they should."""
    started = time.monotonic()
    table = ablation.run(DEFAULT_OUT)
    print("\n" + table.table())
    print(f"  wrote {ablation.draw(table, out)}  ({time.monotonic() - started:.0f} s in-process)")
    started = time.monotonic()
    ros = over_ros(out)
    for name, reached, gap in ros.attempts:
        print(f"  over ROS, {name}: {'reached' if reached else 'missed'} the goal ({gap:.3f} m)")
    print(f"  over ROS, the tree: {ros.status} ({time.monotonic() - started:.0f} s, nodes' log: "
          f"{out / 'reach_nodes.log'})")
    if ros.period_ms is not None:
        print(f"  over ROS, lockstep: a control period every {ros.period_ms[0]:.1f} ms (median), p99 "
              f"{ros.period_ms[1]:.1f} ms: the arm's step and the policy's round trip over DDS, two processes")
    if ros.bag is not None:
        print(f"  its journal {ros.bag.name}: flashrt-replay exit {ros.replay_exit}")
    return ros.status == "SUCCESS" and ros.replay_exit == 0
