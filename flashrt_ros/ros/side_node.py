"""A lean node beside the flashrt lifecycle node, spun by an executor of its own on a thread
of its own.

Two facts of rclpy (Jazzy and Kilted) decide how the node is spun:
- An executor rebuilds its wait set in Python at each wake-up, so a callback's latency pays
  for every entity its executor waits on, and the lifecycle node carries dozens.
- The multi-threaded executor does not wait while its worker pool is behind: a task handed
  to the pool but not yet started is handed over again at each wake-up, and each wake-up
  walks the list of every handed-over task. Under load (a policy stepping, /clock ticking
  under use_sim_time) that loop takes a core and the interpreter lock from every other
  thread, and each torch call of a step, which lets go of that lock, waits to get it back.

So each part that must not wait for another (the capsule services, the policy topics, the
generate action) is served by a side node of its own, and the lifecycle node, which keeps
only timers, the lifecycle and parameter services and /clock, by a single-threaded executor.
A side node's names are resolved as its owner's, so ``~/restore`` stays ``/flashrt/restore``.
"""
from __future__ import annotations

import inspect
import threading
from typing import Callable

from rclpy.executors import Executor, MultiThreadedExecutor, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.parameter import Parameter

from .spinning import spin_until_shutdown


class SideNode:
    """``node``: a node named ``<owner>_<suffix>`` in the owner's namespace. Make its entities,
    then ``start()``; ``stop()`` ends the spinning and destroys the node. ``threads`` > 1 gives
    a multi-threaded executor, for callbacks that block for long (a generate goal) beside ones
    that must still be answered meanwhile (its cancel)."""

    def __init__(self, owner: Node, suffix: str, failed: Callable[[str], None], threads: int = 1) -> None:
        name = f"{owner.get_name()}_{suffix}"
        # Launch renames a node with process-wide __node/__ns remaps, which would give this
        # node the owner's name too; its own remaps come first in rcl's lookup. Wall-clock
        # time, whatever the process was given: a node on sim time subscribes to /clock, and
        # every tick would wake this executor for nothing it serves.
        self.node = Node(name, namespace=owner.get_namespace(), context=owner.context, start_parameter_services=False,
                         cli_args=["--ros-args", "-r", f"__node:={name}", "-r", f"__ns:={owner.get_namespace()}"],
                         parameter_overrides=[Parameter("use_sim_time", value=False)])
        self._failed = failed
        self._executor: Executor = (SingleThreadedExecutor(context=owner.context) if threads == 1
                                    else MultiThreadedExecutor(num_threads=threads, context=owner.context))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._spin, name=suffix.replace("_", "-"), daemon=True)

    def start(self) -> None:
        self._executor.add_node(self.node)
        self._thread.start()

    def _spin(self) -> None:
        spin_until_shutdown(self._executor, self.node.context, self._failed, self._stopped)

    @property
    def alive(self) -> bool:
        """Whether the thread that spins the node is running."""
        return self._thread.is_alive()

    def stop_spinning(self) -> None:
        """The executor takes no new work; what runs (or waits in a multi-threaded executor's
        pool) may still finish. Returns at once: Kilted's multi-threaded executor would
        otherwise wait for its threads, and a goal's thread may be waiting for the context
        lock that a shutdown destroying this node holds. The spinning thread ends at its
        next wake-up, which the executor's shutdown causes (``spin_until_shutdown``)."""
        self._stopped.set()
        if "wait_for_threads" in inspect.signature(self._executor.shutdown).parameters:
            self._executor.shutdown(timeout_sec=0, wait_for_threads=False)
        else:
            self._executor.shutdown(timeout_sec=0)

    def stop(self, join_s: float) -> None:
        """Stop spinning, wait up to ``join_s`` for the spinning thread, destroy the node. A
        callback still running in a multi-threaded executor's pool is not waited for."""
        self.stop_spinning()
        self._thread.join(join_s)
        self.node.destroy_node()
