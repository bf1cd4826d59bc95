"""The waypoint task's resume over ROS: flashrt_sim (task "route", lockstep) and flashrt_node
(the trained waypoint policy, journaling) in processes of their own, and the tree of
``bt.route`` in this one, taking the snapshot when the operator's request arrives.

For each held-out episode, three times: resumed from the tree's snapshot (row (a)), with no
restore (row (d)), and never interrupted (what the loop over ROS does on its own). Each episode
draws its route, its interruption period, point and hold as the in-process ablation does
(``sim.interruption.Interrupted``). The node's journal bag is then replayed (flashrt-replay),
exact on this machine.

    python -m flashrt_ros.demo.resume [--episodes 20] [--out demo_out]   (under make demo's environment)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..sim.interruption import Interrupted
from ..sim.resume_ablation import ABLATION_SEEDS, wilson
from ..sim.train_resume_policy import DEFAULT_OUT
from ..sim.waypoints import PERIODS_PER_WAYPOINT
from .reach import start_pair, stop_processes, wait_for_policy

SIM = "/flashrt_sim"
RESUMES = {"full": "(a) full restore, the tree's snapshot", "none": "(d) no restore",
           "uninterrupted": "the same routes, never interrupted"}
NEVER = 10**9   # an operator's period no episode reaches: the uninterrupted row's


@dataclass
class OverRos:
    """Per resume: the episodes' outcomes (seed, success); the journal bag and its replay."""
    outcomes: dict[str, list[tuple[int, bool]]] = field(default_factory=lambda: {r: [] for r in RESUMES})
    failures: list[str] = field(default_factory=list)   # episodes whose tree did not run to a verdict
    bag: Path | None = None
    replay_exit: int | None = None
    replay_tail: str = ""
    portable_exit: int | None = None   # the same replay at other torch kernels, judged portable
    sim_said: str = ""   # the simulation's account at the end: states it stepped unanswered, commands refused

    def table(self) -> str:
        lines = [f"  {'resume over ROS':<38} {'success':>9} {'95% interval':>16}"]
        for resume, label in RESUMES.items():
            n, k = len(self.outcomes[resume]), sum(ok for _, ok in self.outcomes[resume])
            lo, hi = wilson(k, n) if n else (0.0, 0.0)
            lines.append(f"  {label:<38} {k:>4}/{n:<4} [{lo:5.1%}, {hi:5.1%}]")
        if self.sim_said:
            lines.append(f"  the simulation, at the end: {self.sim_said}")
        return "\n".join(lines)


def run(out: Path, episodes: int = 20, policy: Path = DEFAULT_OUT) -> OverRos:
    """Every row over ROS (see the module docstring); the caller sets the ROS domain."""
    import rclpy
    from rclpy.context import Context

    result, env, procs, context = OverRos(), dict(os.environ), [], Context()
    journals = out / "resume_journal"
    with open(out / "resume_nodes.log", "w") as logs:
        try:
            # A state the policy drops is stepped after the patience: a short one keeps the
            # episodes moving. (The tree holds the arm between episodes, so no answer to a state
            # of the episode before comes after a reset.)
            procs += start_pair(logs, env, ["lockstep_patience:=0.25", "task:=route"], policy, journals)
            rclpy.init(context=context)
            _drive(context, result, range(ABLATION_SEEDS.start, ABLATION_SEEDS.start + episodes))
        finally:
            context.try_shutdown()
            stop_processes(procs)
    bags = sorted(journals.glob("session-*"))
    if bags:
        result.bag = bags[-1]
        replay = [sys.executable, "-m", "flashrt_ros.replay.cli", str(result.bag)]
        done = subprocess.run(replay, capture_output=True, text=True, env=env, timeout=900)
        result.replay_exit, result.replay_tail = done.returncode, (done.stdout + done.stderr)[-1500:]
        # torch's generic kernels, whatever this CPU has: another platform, as far as replay can tell.
        other = dict(env, ATEN_CPU_CAPABILITY="default")
        done = subprocess.run([*replay, "--verdict", "portable"], capture_output=True, text=True, env=other,
                              timeout=900)
        result.portable_exit = done.returncode
    return result


def _drive(context, result: OverRos, seeds: range) -> None:
    import rclpy
    from rclpy.parameter import Parameter
    from rclpy.parameter_client import AsyncParameterClient
    from std_srvs.srv import Trigger

    from ..bt.route import RouteWorld
    from ..ros.spinning import spun

    client = rclpy.create_node("resume_demo", context=context)
    with spun(client):
        world = RouteWorld(client, SIM, "/flashrt")
        sim_params = AsyncParameterClient(client, SIM)
        wait_for_policy(client)
        if not sim_params.wait_for_services(timeout_sec=60):
            raise TimeoutError(f"{SIM}'s parameter services did not come up")
        for seed in seeds:
            _set_seed(sim_params, Parameter("seed", Parameter.Type.INTEGER, seed))
            for resume in RESUMES:
                verdict = _episode(client, world, Interrupted.sample(seed), resume)
                if verdict is None:
                    result.failures.append(f"seed {seed}, {resume}")
                else:
                    result.outcomes[resume].append((seed, verdict))
        # A state stepped unanswered is a period the policy never saw: the loop did not keep up.
        said = world.reset.call_async(Trigger.Request())
        _wait(said, 10, "reset")
        result.sim_said = said.result().message


def _episode(node, world, episode: Interrupted, resume: str) -> bool | None:
    """One episode's tree run to its end: whether the route was done (None: no verdict)."""
    import py_trees
    from py_trees.common import Status

    from ..bt.route import Operator, route_episode

    py_trees.blackboard.Blackboard.clear()
    world.new_episode(episode.route)
    # Uninterrupted: the tree of row (a), whose request never comes. What the loop over ROS
    # does without an interruption, against which rows (a) and (d) are read.
    uninterrupted = resume == "uninterrupted"
    operator = Operator(world, NEVER if uninterrupted else episode.period)
    root, _, _ = route_episode(node, world, operator, episode.point, episode.hold,
                               "full" if uninterrupted else resume)
    tree = py_trees.trees.BehaviourTree(root)
    tree.setup(timeout=15.0)
    budget_s = 60.0 + 0.5 * PERIODS_PER_WAYPOINT * len(episode.route.waypoints) * 3
    deadline = time.monotonic() + budget_s
    try:
        while time.monotonic() < deadline:
            operator()
            tree.tick()
            if root.status == Status.SUCCESS:
                return True
            if root.status == Status.FAILURE:
                tip = root.tip()
                # A route not done in time is the verdict; anything else is no verdict at all.
                return False if tip is not None and tip.name.startswith("follow the route") else None
            time.sleep(0.002)
        return None
    finally:
        root.stop(Status.INVALID)
        tree.shutdown()


def _set_seed(sim_params, seed) -> None:
    """Set the simulation's seed, asking again when no answer comes: a service found ready may
    not yet have discovered this client's reply reader (DDS matches each direction on its own),
    and then its answer is lost. Setting the same seed twice is the same as once."""
    for attempt in range(3):
        try:
            _wait(sim_params.set_parameters([seed]), 10, "parameter")
            return
        except TimeoutError:
            if attempt == 2:
                raise


def _wait(future, timeout_s: float, service: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not future.done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no answer from the simulation's {service} service")
        time.sleep(0.005)


def run_scenario(out: Path, episodes: int = 50, ros_episodes: int = 50, contexts: int = 20) -> bool:
    """make demo, last part: the resume ablation in process (both tables, their pictures), then
    the resume over ROS; whether the journal replayed, exact and portable."""
    from ..bench import agent_resume
    from ..sim import resume_ablation

    started = time.monotonic()
    table = resume_ablation.run(DEFAULT_OUT, range(ABLATION_SEEDS.start, ABLATION_SEEDS.start + episodes))
    print(table.table())
    print(f"  wrote {resume_ablation.draw(table, out)}  ({time.monotonic() - started:.0f} s in-process)")
    started = time.monotonic()
    agent = agent_resume.run(contexts)
    print("\n" + agent.table())
    print(f"  wrote {agent_resume.draw(agent, out / 'agent_resume.png')}  ({time.monotonic() - started:.0f} s)")
    started = time.monotonic()
    ros = run(out, ros_episodes)
    print("\n" + ros.table())
    # Never interrupted, the loop over ROS is the in-process loop (lockstep, the route taken before
    # the episode's first state, visits judged by the simulation's time) unless it lost a period:
    # a state stepped unanswered (the policy slower than the patience) or a command refused.
    alike = [ok == table.uninterrupted[seed - table.seeds.start]
             for seed, ok in ros.outcomes["uninterrupted"] if seed in table.seeds]
    print(f"  never interrupted, episode by episode: {sum(alike)} of {len(alike)} as in process")
    if ros.failures:
        print(f"  no verdict over ROS: {', '.join(ros.failures)}")
    print(f"  over ROS: {time.monotonic() - started:.0f} s, nodes' log {out / 'resume_nodes.log'}")
    if ros.bag is not None:
        print(f"  its journal {ros.bag.name}: flashrt-replay exit {ros.replay_exit} (exact), "
              f"{ros.portable_exit} (portable, at torch's default kernels)")
    return ros.replay_exit == 0 and ros.portable_exit == 0 and not ros.failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--episodes", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("demo_out"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args.out, args.episodes)
    print(result.table())
    if result.failures:
        print(f"  no verdict: {', '.join(result.failures)}")
    if result.bag is not None:
        print(f"  journal {result.bag.name}: flashrt-replay exit {result.replay_exit} (exact), "
              f"{result.portable_exit} (portable, at torch's default kernels)")
    return 0 if result.replay_exit == 0 and result.portable_exit == 0 and not result.failures else 1


if __name__ == "__main__":
    sys.exit(main())
