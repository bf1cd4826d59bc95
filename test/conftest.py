"""Test defaults: keep DDS traffic inside this test run.

`make test` sets these too; the defaults here cover a bare `pytest test/`.
- ROS_AUTOMATIC_DISCOVERY_RANGE=OFF: nodes of one process (one context) still
  talk to each other, nothing else is discovered. A test that talks to another
  process must give both processes ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
  (before rclpy.init) and relies on the run's private ROS_DOMAIN_ID.
- ROS_DOMAIN_ID: private to this run (same host, same domain = crosstalk).
- FASTDDS_BUILTIN_TRANSPORTS=UDPv4: no shared-memory segments in /dev/shm.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "OFF")
os.environ.setdefault("ROS_DOMAIN_ID", str(1 + os.getpid() % 100))
os.environ.setdefault("FASTDDS_BUILTIN_TRANSPORTS", "UDPv4")


@pytest.fixture
def ros_context() -> Iterator["rclpy.context.Context"]:  # noqa: F821
    """A fresh, initialised rclpy Context, shut down after the test.

    Pass it on: ``rclpy.create_node(name, context=ros_context)`` and
    ``SingleThreadedExecutor(context=ros_context)``. Destroy the nodes in the
    test's own fixtures: undestroyed nodes stay visible in later graphs.
    """
    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    try:
        yield context
    finally:
        context.try_shutdown()


@pytest.fixture
def tiny_engine():
    """A fresh embedded-default engine (seed 0) with a short context."""
    from flashrt_ros.runtime import Engine, ModelConfig

    return Engine.from_config(ModelConfig.tiny(), max_seq_len=256)


@pytest.fixture
def kv_server(tmp_path):
    """A real Valkey or Redis server on a free loopback port, stopped by its pid after the test
    (``fleet_harness``; skipped where no server binary is installed)."""
    from fleet_harness import running_server

    yield from running_server(tmp_path)
