"""make demo: why capsules matter, on the embedded default model, over ROS 2.

flashrt_node runs as its own process, in a private ROS domain. This process
drives it over DDS, the way a robot's executive would:

 1. prefill a long task context (cold), and snapshot it as a pinned capsule;
 2. run policy steps whose observations come from the bundled bag;
 3. attempt a skill that fails, roll back, retry (behaviour tree);
 4. fork branches, explore each, keep the best (behaviour tree);
 5. end the session by restoring the task-start capsule instead of
    prefilling the context again, and compare the time to first token;
 6. the trained reaching policy in the simulated arm (demo.reach): the retry
    ablation, and a behaviour tree that rolls the policy back after a jam;
 7. interrupt and resume (demo.resume): the waypoint policy's resume ablation and an
    agent's on data/spec_tiny, in process; then the waypoint task over ROS, the tree
    snapshotting when the operator's request arrives.

It prints one line per operation and a table at the end. It writes
timeline.png, ttft.png, retry_paths.png, resume_ablation.png and agent_resume.png
to --out, and exits non-zero if any step fails.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from ..resources import package_file
from . import reach, resume
from .charts import timeline, ttft_bars

CONTEXT_TOKENS = 4000
DECODE_TOKENS = 32   # after the first token from the capsule: the decode rate


class StepFailed(RuntimeError):
    pass


def _task_context(tokens: int) -> str:
    """A long, deterministic task description: one byte per token for the byte tokenizer."""
    lines, i = [], 0
    while sum(len(s) + 1 for s in lines) < tokens - 1:
        lines.append(f"step {i}: move joint{1 + i % 7} to {((i * 37) % 180) - 90} deg, check gripper, log result.")
        i += 1
    return "\n".join(lines)[:tokens - 1]  # + BOS = tokens


def _bag_observations(limit: int) -> list[list[float]]:
    from ..replay.bag import read_bag

    journal = read_bag(package_file("data/bags/attempt_with_rollback"))
    return [e.request["observation"] for e in journal.entries if e.kind == "step"][:limit]


class Demo:
    def __init__(self, out: Path) -> None:
        import rclpy
        from rclpy.action import ActionClient
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor
        from geometry_msgs.msg import PoseStamped
        from sensor_msgs.msg import JointState
        from trajectory_msgs.msg import JointTrajectoryPoint

        from ..action import Generate
        from ..srv import DropCapsule, ListCapsules, Restore, Snapshot

        self.out, self.steps, self.ttft = out, [], {}
        self.decode_rates: tuple[float, float] | None = None   # tokens/s: seen by this client, in the engine
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "flashrt_ros.ros.main", "--ros-args", "-p", "autostart:=true",
             "-p", "max_seq_len:=8192", "-p", "status_rate:=1.0", "--log-level", "warn"], env=dict(os.environ))
        self.context = Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node("flashrt_demo", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.srv = {name: self.node.create_client(t, f"/flashrt/{name}") for name, t in
                    (("snapshot", Snapshot), ("restore", Restore), ("list_capsules", ListCapsules),
                     ("drop_capsule", DropCapsule))}
        self.generate_client = ActionClient(self.node, Generate, "/flashrt/generate")
        self.Generate = Generate
        # Made now so that discovery runs while the node starts, not on first use.
        self.actions: list = []
        self.node.create_subscription(JointTrajectoryPoint, "/flashrt/action", self.actions.append, 50)
        self.joints_pub = self.node.create_publisher(JointState, "/flashrt/joint_states", 50)
        self.pose_pub = self.node.create_publisher(PoseStamped, "/flashrt/ee_pose", 50)
        # Spun only now: Kilted's rclpy (9.1.2) registers an ActionClient with its node before
        # the client has its lock, so an executor already spinning the node can fail on it.
        self._spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self._spinner.start()

    # ---- plumbing ------------------------------------------------------------------------------
    def _wait(self, future, timeout: float = 120.0):
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(timeout):
            raise StepFailed(f"no answer within {timeout:g} s")
        return future.result()

    def call(self, service: str, **fields: Any):
        client = self.srv[service]
        response = self._wait(client.call_async(client.srv_type.Request(**fields)))
        if not response.success:
            raise StepFailed(f"{service}: {response.message}")
        return response

    def generate(self, prompt: str = "", max_new_tokens: int = 1):
        goal = self.Generate.Goal(prompt=prompt, max_new_tokens=max_new_tokens)
        handle = self._wait(self.generate_client.send_goal_async(goal))
        result = self._wait(handle.get_result_async()).result
        if not result.success:
            raise StepFailed(f"generate: {result.message}")
        return result

    def step(self, name: str, group: str, work: Callable[[], str]) -> None:
        number = len(self.steps) + 1
        print(f"[{number:2d}] {name} ...", flush=True)
        start = time.monotonic()
        ok, label = True, ""
        try:
            label = work()
        except Exception as exc:
            ok, label = False, str(exc)
        seconds = time.monotonic() - start
        self.steps.append({"name": name, "group": group, "start": start - self.t0, "seconds": seconds,
                           "ok": ok, "label": label})
        print(f"     {'ok' if ok else 'FAILED'} in {seconds * 1e3:.1f} ms  {label}", flush=True)
        if not ok:
            raise StepFailed(f"{name}: {label}")

    # ---- the scenario --------------------------------------------------------------------------
    def run(self) -> None:
        self.step("start flashrt_node (load, allocate, activate)", "node", self._come_up)
        context = _task_context(CONTEXT_TOKENS)
        self.step(f"prefill the task context ({CONTEXT_TOKENS} tokens) + first token, cold", "generate",
                  lambda: self._timed_generate("cold", context))
        self.step("snapshot 'task-start' (pinned)", "capsule", self._snapshot_task_start)
        self.step("policy steps from the bundled bag", "policy", self._bag_steps)
        self.step("tree: attempt with rollback (fails once, rolls back, retries)", "tree",
                  lambda: self._tree("attempt-with-rollback"))
        self.step("tree: explore and commit (3 forks, keep the best)", "tree", lambda: self._tree("explore-and-commit"))
        self.step("restore 'task-start' instead of prefilling again", "capsule", self._restore_task_start)
        self.step("first token from the restored capsule", "generate", lambda: self._timed_generate("capsule"))
        self.step(f"generate {DECODE_TOKENS} more tokens", "generate", self._decode)
        self.step("list and verify capsules", "capsule", self._check_capsules)

    def _come_up(self) -> str:
        for client in self.srv.values():
            if not client.wait_for_service(timeout_sec=60):
                raise StepFailed("the node's services did not appear within 60 s")
        deadline = time.monotonic() + 60
        while True:
            listing = self.srv["list_capsules"]
            try:
                # Asked again after 5 s: a first answer can be lost when the node sends it before
                # it has matched this client's reader (Fast DDS then logs "failed to send
                # response"); one long wait for it can then never end. Listing changes nothing.
                response = self._wait(listing.call_async(listing.srv_type.Request()), timeout=5.0)
            except StepFailed:
                response = None
            if response is not None and response.success:
                return "active"
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise StepFailed(f"node not active: {response.message if response is not None else 'no answer'}")
            time.sleep(0.1)

    def _timed_generate(self, key: str, prompt: str = "") -> str:
        start = time.perf_counter()
        result = self.generate(prompt, max_new_tokens=1)
        wall = (time.perf_counter() - start) * 1e3
        self.ttft[key] = wall + self.ttft.get("restore_ms", 0.0) if key == "capsule" else wall
        return f"TTFT {self.ttft[key]:.1f} ms (engine {result.ttft_ms:.1f} ms), position {result.position}"

    def _decode(self) -> str:
        start = time.perf_counter()
        result = self.generate(max_new_tokens=DECODE_TOKENS)
        self.decode_rates = (len(result.tokens) / (time.perf_counter() - start), result.tokens_per_s)
        return (f"{len(result.tokens)} tokens, {self.decode_rates[0]:.1f} tokens/s "
                f"(engine {self.decode_rates[1]:.1f}), position {result.position}")

    def _snapshot_task_start(self) -> str:
        r = self.call("snapshot", name="task-start", pin=True, request_id="demo-task-start")
        self.task_start = r.capsule_id
        return f"capsule {r.capsule_id} at position {r.position}, {r.capsule.nbytes / 2**20:.2f} MiB, {r.latency_ms:.2f} ms"

    def _bag_steps(self) -> str:
        import numpy as np
        from geometry_msgs.msg import PoseStamped
        from sensor_msgs.msg import JointState
        from tqdm import tqdm
        from transforms3d.quaternions import mat2quat

        observations = _bag_observations(12)
        actions, joints_pub, pose_pub = self.actions, self.joints_pub, self.pose_pub
        deadline = time.monotonic() + 10
        while (joints_pub.get_subscription_count() == 0 or pose_pub.get_subscription_count() == 0
               or self.node.count_publishers("/flashrt/action") == 0):
            if time.monotonic() > deadline:
                raise StepFailed("policy topics did not connect")
            time.sleep(0.02)
        names = [f"joint{i}" for i in range(1, 8)]
        for obs in tqdm(observations, desc="     policy steps", unit="step", leave=False):
            rotation = np.stack([obs[17:20], obs[20:23], np.cross(obs[17:20], obs[20:23])], axis=1)
            pose = PoseStamped()
            pose.pose.position.x, pose.pose.position.y, pose.pose.position.z = obs[14:17]
            (pose.pose.orientation.w, pose.pose.orientation.x, pose.pose.orientation.y,
             pose.pose.orientation.z) = (float(v) for v in mat2quat(rotation))
            pose_pub.publish(pose)
            time.sleep(0.01)  # the pose first: the step pairs a joint state with the latest pose
            expected = len(actions) + 1
            joints_pub.publish(JointState(name=names, position=obs[:7], velocity=obs[7:14]))
            while len(actions) < expected:
                if time.monotonic() > deadline + 30:
                    raise StepFailed(f"no action for observation {expected}")
                time.sleep(0.002)
        return f"{len(observations)} observations in, {len(actions)} actions out"

    def _tree(self, name: str) -> str:
        import py_trees

        from ..bt.examples import TREES, run_tree

        py_trees.blackboard.Blackboard.clear()
        root = TREES[name](self.node)
        status = run_tree(root, timeout_s=90)
        if status != py_trees.common.Status.SUCCESS:
            raise StepFailed(f"{name} ended {status.value}\n{py_trees.display.unicode_tree(root, show_status=True)}")
        return f"SUCCESS ({sum(1 for _ in root.iterate())} behaviours)"

    def _restore_task_start(self) -> str:
        start = time.perf_counter()
        r = self.call("restore", capsule_id=self.task_start)
        self.ttft["restore_ms"] = (time.perf_counter() - start) * 1e3
        return f"back at position {r.position}: engine {r.latency_ms:.2f} ms, round trip {self.ttft['restore_ms']:.2f} ms"

    def _check_capsules(self) -> str:
        listed = self.call("list_capsules").capsules
        task = [c for c in listed if c.id == self.task_start]
        if not task or not task[0].pinned:
            raise StepFailed("the pinned task-start capsule is gone")
        self.call("restore", capsule_id=self.task_start, verify=True)
        return f"{len(listed)} capsules; task-start still pinned and verifies"

    # ---- report --------------------------------------------------------------------------------
    def report(self) -> list[Path]:
        print("\n  operation" + " " * 60 + "ms   status")
        for s in self.steps:
            print(f"  {s['name'][:66]:68s} {s['seconds'] * 1e3:9.1f}   {'ok' if s['ok'] else 'FAILED'}")
        pictures = [timeline(self.steps, self.out / "timeline.png", "flashrt_ros demo: operations over ROS 2")]
        if "cold" in self.ttft and "capsule" in self.ttft:
            cold, capsule = self.ttft["cold"], self.ttft["capsule"]
            print(f"\n  TTFT, {CONTEXT_TOKENS}-token task context: cold prefill {cold:.1f} ms; "
                  f"restore capsule + first token {capsule:.1f} ms ({cold / capsule:.1f}x faster)")
            if self.decode_rates:
                print(f"  decode: {self.decode_rates[0]:.1f} tokens/s ({self.decode_rates[1]:.1f} in the engine)")
            print("  (round trips seen by this client, ROS included; embedded default model on CPU)")
            pictures.append(ttft_bars(cold, capsule, CONTEXT_TOKENS, self.out / "ttft.png", "Time to first token"))
        for p in pictures:
            print(f"  wrote {p}")
        return pictures

    def close(self) -> int:
        self.executor.shutdown(timeout_sec=5)
        self._spinner.join(5)  # out of rclpy's C++ wait before the interpreter exits
        self.node.destroy_node()
        self.context.try_shutdown()
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo-output", help="folder for timeline.png and ttft.png")
    args = parser.parse_args(argv)
    # This run's own DDS domain, on this host only: nothing else answers, nothing else hears.
    # Set, not defaulted: a ROS_DOMAIN_ID the user exports for their robot would let this
    # demo find and drive that robot's flashrt node.
    os.environ["ROS_DOMAIN_ID"] = str(150 + os.getpid() % 80)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    os.environ.setdefault("FASTDDS_BUILTIN_TRANSPORTS", "UDPv4")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"flashrt_ros demo: ROS_DOMAIN_ID={os.environ['ROS_DOMAIN_ID']}, output in {out}/")
    demo = Demo(out)
    failed = None
    try:
        demo.run()
    except StepFailed as exc:
        failed = exc
    finally:
        demo.report()
        node_exit = demo.close()
    if failed is not None:
        print(f"\ndemo FAILED: {failed}", file=sys.stderr)
        return 1
    if node_exit != 0:
        print(f"\ndemo FAILED: flashrt_node exited {node_exit} on SIGTERM", file=sys.stderr)
        return 1
    print("\n==> the trained reaching policy in the simulation (flashrt_sim, MuJoCo)")
    if not reach.run_scenario(out):
        print("\ndemo FAILED: the reaching scenario (see above)", file=sys.stderr)
        return 1
    print("\n==> interrupted, then resumed: the waypoint policy, and an agent on data/spec_tiny")
    if not resume.run_scenario(out):
        print("\ndemo FAILED: the resume scenario (see above)", file=sys.stderr)
        return 1
    print("\ndemo OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
