"""The capsule services, answered by a side node (``side_node``) that holds only them.

Their names stay under the lifecycle node's (``/flashrt/restore``), and the handlers are the
lifecycle node's methods, so refusals and the engine lock work as for any other request.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Optional

from rclpy.clock import Clock
from rclpy.node import Node
from rclpy.qos import qos_profile_services_default
from rclpy.service_introspection import ServiceIntrospectionState

from .side_node import SideNode


class CapsuleServices:
    """``services``: (type, name under the owner, handler) triples; ``stop()`` ends them.
    ``observe(type, resolved name, request, response)``: told of every call once it is answered."""

    def __init__(self, owner: Node, services: Iterable[tuple[Any, str, Callable[[Any, Any], Any]]],
                 observe: Optional[Callable[[Any, str, Any, Any], None]] = None) -> None:
        self._side = SideNode(owner, "capsule_services", self._failed)
        self.node = self._side.node
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
        self._side.start()

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

    def _failed(self, trace: str) -> None:
        self.failures += 1
        self.node.get_logger().error(f"capsule service request failed:\n{trace}")

    @property
    def alive(self) -> bool:
        """Whether the thread that serves the services is running."""
        return self._side.alive

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, wait up to ``timeout`` s for handlers in flight, destroy the node."""
        self._side.stop_spinning()
        with self._idle:
            self._idle.wait_for(lambda: not self._running, timeout)
        # Not the full timeout: a spinning thread that asked context.ok() just before a Kilted
        # shutdown took the context's lock waits there until the shutdown returns, and runs
        # nothing meanwhile (``spinning.spin_until_shutdown``).
        self._side.stop(1.0)
