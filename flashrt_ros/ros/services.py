"""The capsule services, answered by a lean node on a thread of their own.

A service's round trip pays for every entity the executor that serves it
waits on: rclpy rebuilds its wait set in Python on each wake-up, and a
multi-threaded executor adds a hand-off to a worker thread. The lifecycle
node carries ~30 entities (lifecycle, parameter and action services, topics,
timers) on a multi-threaded executor; these six services are served by a
single-threaded executor over a node that holds only them. Their names stay
under the lifecycle node's (``/flashrt/restore``), and the handlers are the
lifecycle node's methods, so refusals and the engine lock work as before.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional

from rclpy.clock import Clock
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import qos_profile_services_default
from rclpy.service_introspection import ServiceIntrospectionState

from .spinning import spin_until_shutdown


class CapsuleServices:
    """``services``: (type, name under the owner, handler) triples; ``stop()`` ends them.
    ``observe(type, resolved name, request, response)``: told of every call once it is answered."""

    def __init__(self, owner: Node, services: Iterable[tuple[Any, str, Callable[[Any, Any], Any]]],
                 observe: Optional[Callable[[Any, str, Any, Any], None]] = None) -> None:
        name = f"{owner.get_name()}_capsule_services"
        # Launch renames a node with process-wide __node/__ns remaps, which would give
        # this helper the owner's name too; its own remaps come first in rcl's lookup.
        self.node = Node(name, namespace=owner.get_namespace(), context=owner.context,
                         start_parameter_services=False,
                         cli_args=["--ros-args", "-r", f"__node:={name}", "-r", f"__ns:={owner.get_namespace()}"])
        # Handlers running now: stop() waits for them, since rclpy's executor shutdown does
        # not (in Jazzy and Kilted it returns at once, whatever its timeout).
        self._running = 0
        self._idle = threading.Condition()
        self._services = []
        for srv, name, handler in services:
            # Named as the owner would name them, its remaps applied: a rule for ``~/restore``
            # means the owner's ``~``, which the helper's own expansion would not match.
            resolved = owner.resolve_service_name(f"~/{name}")
            self._services.append(self.node.create_service(srv, resolved,
                                                           self._counted(handler, srv, resolved, observe)))
        self.failures = 0   # requests whose handler or answer raised (each is logged)
        self._executor = SingleThreadedExecutor(context=owner.context)
        self._executor.add_node(self.node)
        self._thread = threading.Thread(target=self._spin, name="capsule-services", daemon=True)
        self._thread.start()

    def _counted(self, handler: Callable[[Any, Any], Any], srv: Any, name: str,
                 observe: Optional[Callable[[Any, str, Any, Any], None]]) -> Callable[[Any, Any], Any]:
        def serve(request: Any, response: Any) -> Any:
            with self._idle:
                self._running += 1
            try:
                answer = handler(request, response)
                if observe is not None:
                    observe(srv, name, request, answer)
                return answer
            finally:
                with self._idle:
                    self._running -= 1
                    if not self._running:
                        self._idle.notify_all()

        return serve

    def introspect(self, clock: Clock, level: str) -> None:
        """Service introspection of every service at ``level`` (off, metadata or contents), its
        events stamped by ``clock`` (the owner's: sim time under use_sim_time)."""
        state = {"off": ServiceIntrospectionState.OFF, "metadata": ServiceIntrospectionState.METADATA,
                 "contents": ServiceIntrospectionState.CONTENTS}[level]
        for service in self._services:
            service.configure_introspection(clock, qos_profile_services_default, state)

    def _spin(self) -> None:
        spin_until_shutdown(self._executor, self.node.context, self._failed)

    def _failed(self, trace: str) -> None:
        self.failures += 1
        self.node.get_logger().error(f"capsule service request failed:\n{trace}")

    @property
    def alive(self) -> bool:
        """Whether the thread that serves the services is running."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, wait up to ``timeout`` s for handlers in flight, destroy the node."""
        self._executor.shutdown(timeout_sec=0)
        with self._idle:
            self._idle.wait_for(lambda: not self._running, timeout)
        # Not the full timeout: Kilted's Context.shutdown destroys the nodes it tracks while
        # holding the context's lock, and this thread, between two waits, is parked on that
        # lock (``context.ok()``) until the shutdown returns. Parked there it runs nothing.
        self._thread.join(1.0)
        self.node.destroy_node()
