"""Where colcon installed this package: the prefix the sourced environment names (a ROS
workspace's install/, wherever it is), else this checkout's install/ (``make setup``)."""
from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]


def _prefix() -> Path:
    for entry in os.environ.get("AMENT_PREFIX_PATH", "").split(os.pathsep):
        if entry and (Path(entry) / "share" / "ament_index" / "resource_index" / "packages" / "flashrt_ros").exists():
            return Path(entry)
    return ROOT / "install" / "flashrt_ros"


PREFIX = _prefix()
EXECUTABLES = PREFIX / "lib" / "flashrt_ros"


def start_node(log: IO[str], *params: str, namespace: str = "") -> subprocess.Popen:
    """The installed flashrt_node in a process of its own, with config/flashrt.yaml, autostart
    and ``params`` (``name:=value``), its output to ``log``; in ``namespace`` if given."""
    args = [str(EXECUTABLES / "flashrt_node"), "--ros-args", "--params-file", str(ROOT / "config" / "flashrt.yaml"),
            "-p", "autostart:=true"]
    if namespace:
        args += ["-r", f"__ns:={namespace}"]
    for param in params:
        args += ["-p", param]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))


class NodeClient:
    """A client node of its own in this process, for the installed node serving in another
    (``node``: its full name): the capsule services named, the generate action, and an executor
    spinning them."""

    def __init__(self, name: str, services: dict[str, Any], node: str = "/flashrt") -> None:
        import rclpy
        from rclpy.action import ActionClient
        from rclpy.context import Context
        from rclpy.executors import SingleThreadedExecutor

        from flashrt_ros.action import Generate

        self.context = Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.services = services
        # Every client before the spin thread: Kilted's rclpy registers an ActionClient with its
        # node before the client has its lock, which an executor spinning the node can trip on.
        self.clients = {k: self.node.create_client(t, f"{node}/{k}") for k, t in services.items()}
        self.actions = ActionClient(self.node, Generate, f"{node}/generate")
        threading.Thread(target=self.executor.spin, daemon=True).start()

    def call(self, service: str, *, idempotent: bool = False, **fields: Any) -> Any:
        """The service's answer, asked again while the node is not active yet (autostart: the
        services exist before activation ends). ``idempotent``: asked again, too, when no answer
        comes within 10 s (three times at most): a service found ready may not yet have
        discovered this client's reply reader (DDS matches each direction on its own), and then
        its answer is lost. Only a request that does the same asked twice may say so."""
        from flashrt_ros.errors import ErrorCode
        from ros_harness import wait_future

        deadline = time.monotonic() + 60
        unanswered = 0
        while True:
            asked = self.clients[service].call_async(self.services[service].Request(**fields))
            try:
                response = wait_future(asked, 10 if idempotent else 60)
            except TimeoutError:
                unanswered += 1
                if not idempotent or unanswered == 3:
                    raise
                continue
            if response.error_code != ErrorCode.NOT_ACTIVE or time.monotonic() > deadline:
                return response
            time.sleep(0.2)

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()
