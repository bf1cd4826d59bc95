"""The flashrt lifecycle node: a thin adapter from ROS 2 to the session layer.

Every decision about state stays in the engine, and request ids, leases and the journal in
the session (``flashrt_ros.serving``). The node turns messages into session calls, exceptions
into error codes, and results into responses, events and telemetry.

What lives as long as the node: its parameters, the capsule services and the generate action
(a client that calls too early gets NOT_ACTIVE, not silence), and ~/events, ~/status and
/diagnostics (a monitor sees "unconfigured"). Everything that serves a configured engine
(``served.Served``: the engine, its session, the journal bag, the policy topics, ~/session,
the lease timer) is made by configure and destroyed by cleanup.

Threads: the lifecycle node keeps its timers, the lifecycle and parameter services and /clock,
and ``flashrt_node`` spins it with a single-threaded executor (the timers keep a callback group
of their own for an application that spins the node with a multi-threaded one).
The generate action (``goals``), the six capsule services (``services``) and the policy topics
(``policy_io``) are served by side nodes, each on a thread of its own (``side_node`` says why);
the engine lock orders them against everything else.
"""
from __future__ import annotations

import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn

from ..errors import ErrorCode, NotActive
from ..runtime import Engine
from ..serving import Session
from . import params
from .answers import LIST, SERVICES, Call
from .convert import outcome
from .goals import GoalQueue
from .rclpy_compat import answer_invalid_transitions
from .reporting import Reporter
from .served import ConfigureFailed, Served
from .services import CapsuleServices

_DIRTY_POLL_S = 0.05     # "on change" status goes out within this


class FlashRTNode(LifecycleNode):
    """Lifecycle: configure loads the model and allocates the arena (-> inactive), activate
    serves (-> active), deactivate stops serving: requests answer NOT_ACTIVE (-> inactive),
    cleanup frees (-> unconfigured). A failed configure keeps nothing (-> unconfigured)."""

    def __init__(self, node_name: str = "flashrt", **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        answer_invalid_transitions(self)
        self.served: Served | None = None
        self.label = "unconfigured"
        self._active = False
        self._configures = 0
        self._status_timer, self._steady = None, None
        self.add_on_set_parameters_callback(self._on_set_parameters)
        params.declare_all(self)
        self.timer_group = MutuallyExclusiveCallbackGroup()
        self.report = Reporter(self, self.record)
        self.goals = GoalQueue(self)
        # Looked up per call (a test injects a fault into ``_answer``).
        self._capsule_services = CapsuleServices(self, [
            (srv, name, lambda request, response, kind=kind, answer=answer: self._answer(kind, answer, request,
                                                                                         response))
            for srv, name, kind, answer in SERVICES], observe=self._record_service)
        # The node's own timers keep wall-clock time, as its leases do: on the node's clock, under
        # use_sim_time with a simulation faster than real time, they would fire on every tick of
        # /clock and take the interpreter from the policy's steps.
        self._steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.create_timer(_DIRTY_POLL_S, self._poll, callback_group=self.timer_group, clock=self._steady)
        self._restart_status_timer(self.get_parameter("status_rate").value)
        self.report.dirty.set()

    # ---- what the rest of the package reads ----------------------------------------------------
    @property
    def session(self) -> Session | None:
        served = self.served
        return served.session if served is not None else None

    @property
    def engine(self) -> Engine | None:
        served = self.served
        return served.engine if served is not None else None

    @property
    def tokenizer(self) -> Any:
        served = self.served
        return served.tokenizer if served is not None else None

    @property
    def serving(self) -> bool:
        return self._active and self.served is not None

    def generating(self) -> bool:
        """Whether a generate goal is running (a policy step would interleave with its tokens)."""
        return self.goals.running()

    # ---- lifecycle -------------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """-> inactive with an engine served; -> unconfigured, with nothing kept, on any failure."""
        self._configures += 1
        vals = params.values(self)
        reason = params.check_together(vals)
        if reason:
            self.get_logger().error(f"configure refused: {reason}")
            return TransitionCallbackReturn.FAILURE
        try:
            self.served = Served.open(self, vals, self._configures)
        except ConfigureFailed as exc:
            self.get_logger().error(f"configure failed: {exc}")
            return TransitionCallbackReturn.FAILURE
        self._capsule_services.introspect(self.get_clock(), vals["service_introspection"])
        e = self.served.engine
        self.get_logger().info(
            f"configured: {'embedded default' if not vals['model_path'] else vals['model_path']} on {e.device} "
            f"({str(e.dtype).removeprefix('torch.')}, {'CUDA graphs' if e.cuda_graphs else 'eager'}), "
            f"arena {e.arena.nbytes / 2**20:.1f} MiB, {len(e.capsules.list())} capsules loaded")
        return self._moved("inactive")

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = True
        super().on_activate(state)
        return self._moved("active")

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False  # a running generation stops at its next committed boundary
        super().on_deactivate(state)
        return self._moved("inactive")

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._moved("unconfigured", free=True)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._moved("finalized", free=True)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        return self._moved("unconfigured", free=True)

    def _moved(self, label: str, free: bool = False) -> TransitionCallbackReturn:
        if free:
            self._active = False
            self._free()
        self.label = label
        self.report.dirty.set()
        return TransitionCallbackReturn.SUCCESS

    def _free(self) -> None:
        served = self.served
        if served is not None:
            with served.engine.lock:  # in-flight operations finish first; request ids and leases go with it
                self.served = None
            served.close()

    def destroy_node(self) -> None:
        # Also reached from a constructor that failed (Kilted's Node.__init__ destroys itself on
        # a refused parameter), before our own attributes exist. And twice: Kilted's
        # Context.shutdown destroys the nodes it tracks, then the owner's cleanup does.
        self._active = False
        if hasattr(self, "goals"):
            self.goals.destroy()
        if hasattr(self, "_capsule_services"):
            self._capsule_services.stop()
        if hasattr(self, "served"):
            self._free()
        super().destroy_node()

    # ---- parameters ------------------------------------------------------------------------------
    def _on_set_parameters(self, changed: list) -> Any:
        result = params.check(changed)
        declared = self._steady is not None   # while declaring, overrides are checked, then read by configure
        if result.successful and declared and any(p.name == "default_tier" and p.value == "disk" for p in changed) \
                and not self.get_parameter("capsule_dir").value:
            result.successful, result.reason = False, "default_tier=disk needs a capsule_dir (set at configure)"
        if result.successful and declared:
            served = self.served
            for p in changed:
                if p.name == "spill" and served is not None:
                    served.session.set_spill(bool(p.value))
                elif p.name == "policy.max_pose_age" and served is not None and served.policy is not None:
                    served.policy.max_pose_age = float(p.value)
                elif p.name == "status_rate":
                    self._restart_status_timer(p.value)
        return result

    def _restart_status_timer(self, rate: float) -> None:
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None
        if rate > 0:
            self._status_timer = self.create_timer(1.0 / rate, self.publish_status, callback_group=self.timer_group,
                                                   clock=self._steady)

    # ---- answers -----------------------------------------------------------------------------------
    def _answer(self, kind: str, answer: Callable[..., Any], request: Any, response: Any) -> Any:
        """``response`` to a capsule service: ``answer`` (``answers``) fills its own fields, this
        the common ones. No exception leaves here: each becomes success=false with its code."""
        self.report.count("requests")
        session = self.session
        info, code, message, position = None, int(ErrorCode.OK), "ok", None
        start = time.perf_counter()
        try:
            if session is None or not self.serving:   # asked again under the lock (``_serving``)
                raise NotActive(f"node is {self.label}, not active: activate it to serve {kind}")
            served = self.served
            call = Call(session, self.get_parameter("default_tier").value, lambda: self._serving(session, kind),
                        served.fleet if served is not None else None, self.get_parameter("fleet.timeout_s").value)
            info, message, position = answer(request, response, call)
            message = message or "ok"
        except Exception as exc:
            code, message = outcome(exc)
            self.report.count("failed_requests")
            if code == ErrorCode.INTERNAL:
                self.get_logger().error(f"{kind} failed: {message}\n{traceback.format_exc()}")
            else:
                self.get_logger().info(f"{kind} refused ({ErrorCode(code).name}): {message}")
        if session is not None:
            response.position = session.engine.position if position is None else position
        ms = (time.perf_counter() - start) * 1e3
        response.success, response.error_code, response.message, response.latency_ms = code == 0, code, message, ms
        self.report.latencies.add(kind, ms)
        if kind != LIST:
            self.report.event(kind, info, response)
            self.report.dirty.set()
        self.report_journal()
        return response

    @contextmanager
    def _serving(self, session: Session, kind: str) -> Iterator[None]:
        """The engine lock, held while the node serves ``session``: a cleanup lets go of the
        session under it, so what is asked under it cannot outlive the engine."""
        with session.engine.lock:
            if not self.serving or self.session is not session:
                raise NotActive(f"node is {self.label}, not active: activate it to serve {kind}")
            yield

    def report_journal(self) -> None:
        """A journal that stopped (its disk filled, say) is said once; serving goes on."""
        session = self.session
        if session is not None and session.journal_failure:
            self.get_logger().error(f"journal stopped: {session.journal_failure}; the node keeps serving")
            session.journal_failure = ""

    def policy_stepped(self) -> None:
        self.report.count("policy_steps")
        self.report.dirty.set()   # "on change" status: sent within the poll interval, not per step
        self.report_journal()

    # ---- the journal bag and telemetry -------------------------------------------------------------
    def record(self, topic: str, msg: Any) -> None:
        """``msg`` into the journal bag, if one records, on ``topic`` as this node resolves it."""
        served = self.served
        if served is not None and served.bag is not None:
            served.bag.message(self.resolve_topic_name(topic), msg)

    def _record_service(self, srv: Any, name: str, request: Any, response: Any) -> None:
        served = self.served
        if served is not None and served.bag is not None:
            served.bag.service_event(srv, name, request, response)

    def _poll(self) -> None:
        if self.report.dirty.is_set():
            self.publish_status()

    def publish_status(self) -> None:
        served = self.served
        self.report.status(self.label, self.session, self.goals.running(), self._capsule_services.failures,
                           served.fleet_watch if served is not None else None)
