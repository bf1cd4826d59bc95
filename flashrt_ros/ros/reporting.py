"""What the node says about its work: ~/events, ~/status and /diagnostics, and the counts behind them.

These live as long as the node, whatever its lifecycle state: a monitor sees "unconfigured"
on ~/status, and a refusal made before configure is announced like any other answer.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any, Callable, NamedTuple

from diagnostic_msgs.msg import DiagnosticArray
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from ..capsule import CapsuleInfo
from ..errors import ErrorCode
from ..msg import CapsuleEvent, RuntimeStatus
from ..serving import Session
from .convert import info_msg
from .telemetry import Latencies, diagnostics_msg, fleet_diagnostics, status_msg

STATUS_QOS = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)
_EVENTS_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
# What the store announces on its own, after the operation that caused it.
_STORE_EVENTS = {"spill": "capsule {id} moved to {tier}", "evict": "capsule {id} evicted",
                 "digest": "capsule {id} digest {digest16}...",
                 "pull": "capsule {id} pulled from the fleet tier into {tier} ({nbytes} bytes)"}


class Unasked(NamedTuple):
    """The answer fields of an event no request asked for (a lease ended, the state filled up)."""

    position: int
    message: str
    success: bool = True
    error_code: int = 0
    latency_ms: float = 0.0


class Reporter:
    """Publishes events and status for ``node``; ``record(topic, msg)`` puts each event in the
    journal bag too. ``counters`` and ``latencies`` go out on /diagnostics; ``dirty`` asks for
    the next status ("on change", sent by the node's poll)."""

    def __init__(self, node: Node, record: Callable[[str, Any], None]) -> None:
        self._node, self._record = node, record
        self.counters = {"requests": 0, "failed_requests": 0, "policy_steps": 0, "rejected_observations": 0,
                         "status_failures": 0}
        self.latencies = Latencies()
        self.dirty = threading.Event()
        self._events = node.create_publisher(CapsuleEvent, "~/events", _EVENTS_QOS)
        self._status = node.create_publisher(RuntimeStatus, "~/status", STATUS_QOS)
        self._diagnostics = node.create_publisher(DiagnosticArray, "/diagnostics", 10)

    def count(self, name: str) -> None:
        self.counters[name] += 1

    def event(self, kind: str, info: CapsuleInfo | None, answer: Any) -> None:
        """An event of ``kind`` with the answer's fields (a service response, or ``Unasked``)."""
        try:
            self._publish(CapsuleEvent(kind=kind, capsule=info_msg(info), position=answer.position,
                                       latency_ms=answer.latency_ms, success=answer.success,
                                       error_code=answer.error_code, message=answer.message))
        except Exception:  # the answer is what matters: an event that cannot go out must not cost it
            if self._node.context.ok():   # else a shutdown landed first: nobody is left to hear it
                self._node.get_logger().error(f"{kind} event not published:\n{traceback.format_exc()}")

    def store_event(self, kind: str, info: CapsuleInfo, position: int) -> None:
        """What happened inside other operations, or after them: a spill, an eviction, a
        snapshot's digest once its background hash is done (its answer carried an empty one)."""
        text = _STORE_EVENTS.get(kind)
        if text is not None:
            message = text.format(id=info.id, tier=info.tier, digest16=info.digest[:16], nbytes=info.nbytes)
            self.event(kind, info, Unasked(position=position, message=message))

    def fleet_event(self, reachable: bool, error: str, position: int) -> None:
        """The fleet tier's server answers again, or no longer (``error``: why)."""
        if reachable:
            self.event("fleet", None, Unasked(position=position, message="fleet tier reachable"))
        else:
            self.event("fleet", None, Unasked(position=position, message=error, success=False,
                                              error_code=int(ErrorCode.FLEET_UNAVAILABLE)))

    def _publish(self, msg: CapsuleEvent) -> None:
        msg.header.stamp = self._node.get_clock().now().to_msg()
        self._events.publish(msg)
        self._record("~/events", msg)

    def status(self, label: str, session: Session | None, generating: bool, failures: int,
               fleet_watch: Any = None) -> None:
        """~/status and /diagnostics now; a fault is counted and logged, never raised (an engine
        fault, a sticky CUDA error say, must not stop the executor that calls this)."""
        try:
            self.dirty.clear()
            now = self._node.get_clock().now().to_msg()
            if session is None:
                status = status_msg(label, None, "", now)
            else:
                with session.engine.lock:   # one moment for every field: the digest is the position's
                    # Not while a goal commits tokens: hashing the state every poll period would cost
                    # it decode steps. Its end marks the status dirty, and the digest follows then.
                    digest = "" if generating else session.status_digest()
                    status = status_msg(label, session.engine, digest, now)
            self._status.publish(status)
            counters = {**self.counters, "service_failures": failures}
            array = diagnostics_msg(self._node.get_name(), status, self.latencies, counters, now)
            if fleet_watch is not None:
                array.status.append(fleet_diagnostics(self._node.get_name(), fleet_watch,
                                                      fleet_watch.fleet.stats()))
            self._diagnostics.publish(array)
        except Exception:
            if not self._node.context.ok():   # a SIGTERM landed while the timer ran: not a fault
                return
            self.counters["status_failures"] += 1
            self._node.get_logger().error(f"status not published:\n{traceback.format_exc()}",
                                          throttle_duration_sec=5.0)
