"""A live flashrt node and a client node in one process, over real rclpy and DDS.

Single-threaded executors spin the two nodes, each in a background thread of its own, as
``flashrt_node`` spins its node; callers block on a future's done-callback (the fast way, per the notes),
never on spinning.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any

from rclpy.action import ActionClient
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from flashrt_ros.action import Generate
from flashrt_ros.ros.node import FlashRTNode
from flashrt_ros.srv import DropCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot

STATUS_QOS = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)
SERVICES = {"snapshot": Snapshot, "restore": Restore, "fork": Fork, "rollback": Rollback,
            "list_capsules": ListCapsules, "drop_capsule": DropCapsule}


def wait_future(future, timeout: float = 30.0):
    done = threading.Event()
    future.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError("no answer within %.0f s" % timeout)
    return future.result()


class Harness:
    def __init__(self, context, overrides: dict[str, Any] | None = None, activate: bool = True,
                 name: str = "flashrt") -> None:
        values = {"max_seq_len": 512, "status_rate": 0.0, **(overrides or {})}
        self.node = FlashRTNode(name, context=context,
                                parameter_overrides=[Parameter(k, value=v) for k, v in values.items()])
        self.client = _client_node(context)
        self.clients = {k: self.client.create_client(t, f"/{name}/{k}") for k, t in SERVICES.items()}
        self.generate_client = ActionClient(self.client, Generate, f"/{name}/generate")
        # Each on an executor of its own, as two processes would be: the node's executor waits
        # while a timer of its waits for the engine lock, and the client must go on meanwhile.
        self.executor = SingleThreadedExecutor(context=context)
        self.executor.add_node(self.node)
        self.client_executor = SingleThreadedExecutor(context=context)
        self.client_executor.add_node(self.client)
        self._closing = False
        self._thread = threading.Thread(target=self._spin, args=(self.executor,), daemon=True)
        self._client_thread = threading.Thread(target=self._spin, args=(self.client_executor,), daemon=True)
        for thread in (self._thread, self._client_thread):
            thread.start()
        for client in self.clients.values():
            assert client.wait_for_service(timeout_sec=10)
        if activate:
            self.node.trigger_configure()
            self.node.trigger_activate()

    def call(self, service: str, timeout: float = 30.0, **fields: Any):
        request = SERVICES[service].Request(**fields)
        return wait_future(self.clients[service].call_async(request), timeout)

    def generate(self, prompt: str = "", token_ids=(), max_new_tokens: int = 8, feedback=None,
                 timeout: float = 60.0, temperature: float = 0.0, seed: int = -1, speculative: int = -1,
                 top_k: int = 0, top_p: float = 1.0):
        assert self.generate_client.wait_for_server(timeout_sec=10)
        goal = Generate.Goal(prompt=prompt, token_ids=list(token_ids), max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, speculative=speculative)
        handle = wait_future(self.generate_client.send_goal_async(goal, feedback_callback=feedback), timeout)
        assert handle.accepted
        return handle, handle.get_result_async()

    def policy_publishers(self, timeout: float = 10.0):
        """Publishers on the node's ~/joint_states and ~/ee_pose, returned once the node's
        subscriptions have matched them."""
        from geometry_msgs.msg import PoseStamped
        from sensor_msgs.msg import JointState

        joints = self.client.create_publisher(JointState, f"/{self.node.get_name()}/joint_states", 50)
        poses = self.client.create_publisher(PoseStamped, f"/{self.node.get_name()}/ee_pose", 10)
        deadline = time.monotonic() + timeout
        while joints.get_subscription_count() == 0 or poses.get_subscription_count() == 0:
            assert time.monotonic() < deadline, "the node's policy subscriptions did not match"
            time.sleep(0.01)
        return joints, poses

    def _spin(self, executor) -> None:
        try:
            executor.spin()
        except ExternalShutdownException:   # the context shut down: spinning ends, as in flashrt_node
            pass
        except Exception:
            # rclpy: a task that ends while shutdown destroys the executor's guard condition
            # raises InvalidHandle from spin; only an error before close() is the test's business.
            if not self._closing:
                raise

    def close(self) -> None:
        self._closing = True
        for executor in (self.executor, self.client_executor):
            executor.shutdown(timeout_sec=5)
        for thread in (self._thread, self._client_thread):
            thread.join(5)   # before the nodes go: a handler still running would touch them
        self.node.destroy_node()
        self.client.destroy_node()


def _client_node(context):
    import rclpy

    return rclpy.create_node(f"flashrt_test_client_{int(time.monotonic_ns() % 1_000_000)}", context=context)


@contextmanager
def spun_client(context):
    """A client node spun alone by a single-threaded executor on a thread; torn down on exit."""
    client = _client_node(context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(client)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    try:
        yield client
    finally:
        executor.shutdown(timeout_sec=5)
        spinner.join(5)
        client.destroy_node()
