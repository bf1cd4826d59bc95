"""Two robots and a fleet tier: two flashrt_node processes from install/, one real Valkey/Redis
server on loopback, driven from this process over DDS.

Node A prefills and publishes; node B restores A's capsule by name and generates A's tokens;
B restarts and restores it again; a fork made on B restores on A. Each node's journal bag then
replays exact, its pulls taken from the fleet again. With the server stopped, a fleet request
is refused with FLEET_UNAVAILABLE and the live state stays as it was.
"""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytest.importorskip("rclpy")

from flashrt_ros.errors import ErrorCode  # noqa: E402
from install_space import EXECUTABLES, NodeClient, start_node  # noqa: E402
from fleet_harness import new_server  # noqa: E402
from ros_harness import SERVICES, wait_future  # noqa: E402

EXECUTABLE = EXECUTABLES / "flashrt_node"
KEY = b"fleet-robots-key-" + b"r" * 16
CONTEXT = "The task: pick the red cup from the second shelf, then place it on the tray by the door. "


class Robot:
    """One node process in namespace ``/<name>``, and a client of it."""

    def __init__(self, name: str, tmp_path, fleet_url: str, key_file) -> None:
        self.name, self.tmp_path = name, tmp_path
        self.params = ("max_seq_len:=512", f"fleet.url:={fleet_url}", f"capsule_key_file:={key_file}",
                       f"journal_path:={tmp_path / name / 'journal'}", "fleet.timeout_s:=3.0")
        self.log = open(tmp_path / f"{name}.log", "a+")
        self.client = NodeClient(f"fleet_test_client_{name}", SERVICES, node=f"/{name}/flashrt")
        self.proc = None
        self.start()

    def start(self) -> None:
        self.proc = start_node(self.log, *self.params, namespace=f"/{self.name}")
        for c in self.client.clients.values():
            assert c.wait_for_service(timeout_sec=90), f"{self.name} did not come up:\n{self.tail()}"
        assert self.client.actions.wait_for_server(timeout_sec=30)
        # Active (the call is asked again while NOT_ACTIVE), and this client's reply path matched.
        assert self.call("list_capsules", idempotent=True).success

    def call(self, service: str, **fields):
        return self.client.call(service, **fields)

    def generate(self, prompt: str, n: int) -> list[int]:
        from flashrt_ros.action import Generate

        try:
            handle = wait_future(self.client.actions.send_goal_async(Generate.Goal(prompt=prompt, max_new_tokens=n)),
                                 60)
            result = wait_future(handle.get_result_async(), 120).result
        except TimeoutError:
            raise AssertionError(f"{self.name} (exit status {self.proc.poll()}) answered no goal:\n{self.tail()}")
        assert result.success, result.message
        return list(result.tokens)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                assert self.proc.wait(timeout=20) == 0, self.tail()
            finally:
                if self.proc.poll() is None:
                    self.proc.kill()
                    self.proc.wait()

    def close(self) -> None:
        try:
            self.stop()
        finally:
            self.client.close()
            self.log.close()

    def tail(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-4000:]

    def journals(self) -> list:
        return sorted(p for p in (self.tmp_path / self.name / "journal").iterdir() if p.is_dir())


@pytest.mark.skipif(not EXECUTABLE.exists(), reason="needs the colcon install space (make test builds it)")
def test_two_robots_share_state_through_a_real_server(tmp_path, monkeypatch):
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    # Persistent, as a fleet's server is deployed (docs/fleet.md): what it held is back after a restart.
    (tmp_path / "kv").mkdir()
    kv_server = new_server(tmp_path / "kv", args=["--appendonly", "yes", "--appendfsync", "always"])
    kv_server.start()
    try:
        key_file = tmp_path / "fleet.key"
        key_file.write_bytes(KEY)
        a = Robot("robot_a", tmp_path, kv_server.url, key_file)
        b = Robot("robot_b", tmp_path, kv_server.url, key_file)
        try:
            # A prefills the shared context and publishes it; B restores it by name.
            a.generate(CONTEXT, 1)
            published = a.call("snapshot", name="task", tier="fleet", lease_s=0.0)
            assert published.success, published.message
            assert published.capsule.tier == "fleet" and published.capsule.digest
            # A's own capsule, restored through the fleet: served from A's store, nothing pulled
            # (its journal, replayed, makes the snapshot under another id and must not pull it).
            assert a.call("restore", capsule_id="task", tier="fleet").success
            assert "task" in [c.name for c in b.call("list_capsules", tier="fleet").capsules]
            restored = b.call("restore", capsule_id="task", tier="fleet", verify=True)
            assert restored.success, restored.message
            assert restored.capsule_id == published.capsule_id and restored.position == published.position
            expected = a.generate(" next:", 12)
            assert b.generate(" next:", 12) == expected

            # B restarts with nothing local, and restores A's capsule again.
            b.stop()
            b.start()
            assert b.call("restore", capsule_id="task", tier="fleet").position == published.position
            assert b.generate(" next:", 12) == expected

            # A fork made on B (of its live state, past A's capsule) restores on A.
            forked = b.call("fork", name="b-branch", tier="fleet")
            assert forked.success, forked.message
            after_fork = b.generate(" then:", 8)
            on_a = a.call("restore", capsule_id="b-branch", tier="fleet", verify=True)
            assert on_a.success and on_a.position == forked.position, on_a.message
            assert a.generate(" then:", 8) == after_fork

            # Server down: refused with its code, the live state and the local tiers as they were.
            before = b.call("list_capsules")
            kv_server.stop()
            for service, fields in (("restore", {"capsule_id": "task", "tier": "fleet"}),
                                    ("snapshot", {"name": "x", "tier": "fleet"}),
                                    ("list_capsules", {"tier": "fleet"})):
                down = b.call(service, **fields)
                assert not down.success and down.error_code == ErrorCode.FLEET_UNAVAILABLE, (service, down.message)
            after = b.call("list_capsules")
            assert after.position == before.position
            assert sorted(c.id for c in after.capsules) == sorted(c.id for c in before.capsules)
            kv_server.start()
            assert b.call("restore", capsule_id="task", tier="fleet").success

            # A server that stops answering: the fleet request is refused when its exchange's timeout
            # runs out, and the node serves a goal meanwhile.
            from flashrt_ros.srv import Restore

            kv_server.pause()
            try:
                stalled = b.client.clients["restore"].call_async(Restore.Request(capsule_id="task", tier="fleet"))
                assert len(b.generate(" meanwhile", 4)) == 4
                answer = wait_future(stalled, 60)
            finally:
                kv_server.resume()
            assert answer.error_code == ErrorCode.FLEET_UNAVAILABLE, answer.message
            assert "did not answer within" in answer.message
            again = b.call("snapshot", name="again", tier="fleet")
            assert again.success, again.message
            # B drops it: the local capsule, and B's reference, the last, so the fleet's copy too.
            dropped = b.call("drop_capsule", capsule_id=again.capsule_id)
            assert dropped.success and "the last one" in dropped.message, dropped.message
            assert "again" not in [c.name for c in a.call("list_capsules", tier="fleet").capsules]
        finally:
            a.close()
            b.close()

        # Each journal replays exact; a pull is pulled again from the server, by id.
        for robot in (a, b):
            for bag in robot.journals():
                run = subprocess.run([sys.executable, "-m", "flashrt_ros.replay.cli", str(bag), "--capsule-key-file",
                                      str(key_file), "--fleet-url", kv_server.url, "--verdict", "exact"],
                                     capture_output=True, text=True, timeout=300)
                assert run.returncode == 0, f"{bag}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    finally:
        kv_server.stop()
