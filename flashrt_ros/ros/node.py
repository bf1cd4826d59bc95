"""The flashrt lifecycle node: a thin adapter from ROS 2 to the session layer.

Every decision about state stays in the engine, and request ids, leases and the journal in
the session (``flashrt_ros.serving``). The node turns messages into session calls, exceptions
into error codes, and results into responses, events and telemetry.

Callback groups: the generate action has its own, policy topics a mutually
exclusive one (observations apply in arrival order), timers another. The six
capsule services are served apart, by ``services.CapsuleServices`` on a
thread of its own; the engine lock orders them against everything else.
"""
from __future__ import annotations

import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

from diagnostic_msgs.msg import DiagnosticArray

from ..action import Generate
from ..capsule import CapsuleInfo, signing
from ..errors import Busy, ErrorCode, FlashRTError, InvalidArgument, NotActive, shown
from ..msg import CapsuleEvent, JournalSession, RuntimeStatus
from ..replay.session import session_of
from ..runtime import Engine
from ..runtime.tokenizer import load_tokenizer
from ..serving import Journal, Session
from ..serving.journal import DROP, FORK, RESTORE, ROLLBACK, SNAPSHOT
from ..serving.operations import Applied, requested
from ..srv import DropCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from . import params
from .convert import info_msg, outcome, session_msg
from .generation import run_generation
from .policy_io import PolicyIO
from .rclpy_compat import answer_invalid_transitions
from .recorder import Recorder
from .services import CapsuleServices
from .telemetry import Latencies, diagnostics_msg, status_msg

_STATUS_QOS = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)
_EVENTS_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
_DIRTY_POLL_S = 0.05     # "on change" status goes out within this; leases end within it too
MAX_WAITING_GOALS = 1    # generate goals that wait behind the running one (each holds an executor thread)


class _Unasked(NamedTuple):
    """The answer fields of an event no request asked for (a lease ended, the state filled up)."""

    position: int
    message: str
    success: bool = True
    error_code: int = 0
    latency_ms: float = 0.0


class FlashRTNode(LifecycleNode):
    """Lifecycle: configure loads the model and allocates the arena, activate serves,
    deactivate stops serving (requests answer NOT_ACTIVE), cleanup frees."""

    def __init__(self, node_name: str = "flashrt", **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        answer_invalid_transitions(self)
        self._status_timer = None
        self.session: Session | None = None
        self.add_on_set_parameters_callback(self._on_set_parameters)
        params.declare_all(self)
        self.tokenizer = None
        self._bag: Recorder | None = None   # the journal bag, while a journal_path records one
        self._configures = 0
        self._label = "unconfigured"
        self._active = False
        self._generation = threading.Lock()   # held by the goal that runs
        self._queue_lock, self._waiting_goals = threading.Lock(), 0
        self._latencies = Latencies()
        self._counters = {"requests": 0, "failed_requests": 0, "policy_steps": 0, "rejected_observations": 0,
                          "status_failures": 0}
        self._dirty = threading.Event()

        self._action_group = ReentrantCallbackGroup()
        self._timer_group = MutuallyExclusiveCallbackGroup()
        self._capsule_services = CapsuleServices(self, (
            (Snapshot, "snapshot", self._snapshot), (Restore, "restore", self._restore), (Fork, "fork", self._fork),
            (Rollback, "rollback", self._rollback), (ListCapsules, "list_capsules", self._list),
            (DropCapsule, "drop_capsule", self._drop)), observe=self._record_service)
        self._generate_server = ActionServer(
            self, Generate, "~/generate", self._execute_generate, goal_callback=lambda _: GoalResponse.ACCEPT,
            cancel_callback=lambda _: CancelResponse.ACCEPT, callback_group=self._action_group)
        self._policy_io: PolicyIO | None = None   # made by configure, destroyed by cleanup
        self._events = self.create_publisher(CapsuleEvent, "~/events", _EVENTS_QOS)
        self._status_pub = self.create_publisher(RuntimeStatus, "~/status", _STATUS_QOS)
        self._session_pub = self.create_publisher(JournalSession, "~/session", _STATUS_QOS)
        self._diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # The node's own timers keep wall-clock time, as its leases do: on the node's clock, under
        # use_sim_time with a simulation faster than real time, they would fire on every tick of
        # /clock and take the interpreter from the policy's steps.
        self._steady = Clock(clock_type=ClockType.STEADY_TIME)
        self.create_timer(_DIRTY_POLL_S, self._poll, callback_group=self._timer_group, clock=self._steady)
        self._restart_status_timer(self.get_parameter("status_rate").value)
        self._dirty.set()

    # ---- lifecycle -------------------------------------------------------------------------------
    @property
    def engine(self) -> Engine | None:
        session = self.session
        return session.engine if session is not None else None

    @property
    def journal(self) -> Journal | None:
        session = self.session
        return session.journal if session is not None else None

    @journal.setter
    def journal(self, journal: Journal | None) -> None:
        if self.session is not None:
            self.session.journal = journal

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._configures += 1
        vals = params.values(self)
        reason = params.check_together(vals)
        if reason:
            self.get_logger().error(f"configure refused: {reason}")
            return TransitionCallbackReturn.FAILURE
        try:
            engine, self.tokenizer = self._build(vals)
        except Exception as exc:  # any failure to load is a failed transition, never a dead node
            self.get_logger().error(f"configure failed: {outcome(exc)[1]}")
            return TransitionCallbackReturn.FAILURE
        self.session = Session(engine)
        if vals["journal_path"]:
            try:
                self._start_journal(vals)
            except Exception as exc:
                self.get_logger().error(f"configure failed: journal_path: {outcome(exc)[1]}")
                self._free()
                return TransitionCallbackReturn.FAILURE
        self._policy_io = PolicyIO(self, vals, self._record, self._context_full, self._policy_stepped,
                                   self._observation_rejected)
        try:
            self._policy_io.start_episodes()
        except Exception as exc:
            self.get_logger().error(f"configure failed: episode-start capsule: {outcome(exc)[1]}")
            self._free()
            return TransitionCallbackReturn.FAILURE
        self._capsule_services.introspect(self.get_clock(), vals["service_introspection"])
        try:
            self._session_pub.publish(session_msg(self._served(vals), self.get_clock().now().nanoseconds))
        except Exception as exc:   # the record is for replay; serving does not depend on it
            self.get_logger().error(f"~/session not published: {outcome(exc)[1]}")
        e = self.engine
        self.get_logger().info(
            f"configured: {'embedded default' if not vals['model_path'] else vals['model_path']} on {e.device} "
            f"({str(e.dtype).removeprefix('torch.')}, {'CUDA graphs' if e.cuda_graphs else 'eager'}), "
            f"arena {e.arena.nbytes / 2**20:.1f} MiB, {len(e.capsules.list())} capsules loaded")
        return self._moved("inactive")

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = True
        return self._moved("active")

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False  # a running generation stops at its next committed boundary
        return self._moved("inactive")

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._free()
        return self._moved("unconfigured")

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._free()
        return self._moved("finalized")

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._free()
        return self._moved("unconfigured")

    def _moved(self, label: str) -> TransitionCallbackReturn:
        self._label = label
        self._dirty.set()
        return TransitionCallbackReturn.SUCCESS

    def _build(self, vals: dict[str, Any]) -> tuple[Engine, Any]:
        device = vals["device"]
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidArgument(f"device={device!r} but CUDA is not available (torch {torch.__version__})")
        opts = dict(device=device, dtype=getattr(torch, vals["dtype"]), max_seq_len=vals["max_seq_len"],
                    cuda_graphs=vals["cuda_graphs"], cpu_kernels=vals["cpu_kernels"],
                    capsule_dir=vals["capsule_dir"] or None,
                    capsule_key=signing.load_key(vals["capsule_key_file"]) if vals["capsule_key_file"] else None,
                    budgets=params.budgets(vals), spill=vals["spill"], rollback_depth=vals["rollback_depth"],
                    max_draft_tokens=vals["max_draft_tokens"])
        engine = Engine.load(vals["model_path"], seed=vals["seed"], mtp_head=vals["mtp_head"] or None,
                             policy_dims=(vals["policy.obs_dim"], vals["policy.action_dim"]), **opts)
        try:
            return engine, load_tokenizer(vals["model_path"])
        except BaseException:
            engine.close()   # its arena, pool and digest thread: a failed configure keeps nothing
            raise

    def _start_journal(self, vals: dict[str, Any]) -> None:
        folder = Path(vals["journal_path"])
        folder.mkdir(parents=True, exist_ok=True)
        # The node name too: two nodes of one process may share journal_path and start in the same second.
        path = folder / (f"session-{time.strftime('%Y%m%d-%H%M%S')}-{self.get_name()}-{os.getpid()}"
                         f"-{self._configures}")
        journal = Journal(session=self._served(vals))
        self._bag = Recorder(path, journal.session, self)
        journal.listeners.append(self._bag)
        self.session.journal = journal
        self.get_logger().info(f"journal: recording into {path}")

    def _served(self, vals: dict[str, Any]) -> dict[str, Any]:
        """The engine's session record (``replay.session``) and how this node serves it: what
        replay of a bag of its topics and service events needs (see msg/JournalSession.msg)."""
        return {**session_of(self.engine, vals["model_path"], vals["seed"]),
                "node": self.get_fully_qualified_name(), "default_tier": vals["default_tier"],
                "joint_names": list(vals["policy.joint_names"]), "max_pose_age": float(vals["policy.max_pose_age"]),
                "joint_states_topic": self.resolve_topic_name("~/joint_states"),
                "ee_pose_topic": self.resolve_topic_name("~/ee_pose"), "action_topic": self.resolve_topic_name("~/action")}

    def _free(self) -> None:
        io, self._policy_io = self._policy_io, None
        if io is not None:
            io.close()
        bag, self._bag = self._bag, None
        if self.session is not None:
            self.session.journal = None
        if bag is not None:
            try:
                bag.close()
            except Exception as exc:  # e.g. its folder was deleted: the engine is freed all the same
                self.get_logger().error(f"journal could not be closed: {exc}")
        engine = self.engine
        if engine is None:
            return
        with engine.lock:  # in-flight operations finish first; request ids and leases go with the session
            self.session = None
        engine.close()
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- parameters ------------------------------------------------------------------------------
    def _on_set_parameters(self, changed: list) -> Any:
        result = params.check(changed)
        if result.successful and any(p.name == "default_tier" and p.value == "disk" for p in changed) \
                and hasattr(self, "_timer_group") and not self.get_parameter("capsule_dir").value:
            result.successful, result.reason = False, "default_tier=disk needs a capsule_dir (set at configure)"
        if result.successful:
            for p in changed:
                session = self.session
                if p.name == "spill" and session is not None:
                    session.set_spill(bool(p.value))
                elif p.name == "policy.max_pose_age" and getattr(self, "_policy_io", None) is not None:
                    self._policy_io.max_pose_age = float(p.value)   # (not while declaring)
                elif p.name == "status_rate" and hasattr(self, "_timer_group"):  # not while declaring
                    self._restart_status_timer(p.value)
        return result

    def _restart_status_timer(self, rate: float) -> None:
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None
        if rate > 0:
            self._status_timer = self.create_timer(1.0 / rate, self._publish_status, callback_group=self._timer_group,
                                                   clock=self._steady)

    # ---- services ----------------------------------------------------------------------------------
    def _serve(self, kind: str, response: Any,
               call: Callable[[Session], tuple[CapsuleInfo | None, str, int | None]]) -> Any:
        """Run ``call`` on the session and fill the common response fields.

        ``call`` returns the capsule involved, a message ("" for "ok") and the position to
        answer (None: the state's). No exception leaves this method: each becomes
        success=false with its code.
        """
        self._counters["requests"] += 1
        session = self.session
        info, code, message, position = None, int(ErrorCode.OK), "ok", None
        start = time.perf_counter()
        try:
            if not self._active or session is None:
                raise NotActive(f"node is {self._label}, not active: activate it to serve {kind}")
            info, message, position = call(session)
            message = message or "ok"
        except Exception as exc:
            code, message = outcome(exc)
            self._counters["failed_requests"] += 1
            if code == ErrorCode.INTERNAL:
                self.get_logger().error(f"{kind} failed: {message}\n{traceback.format_exc()}")
            else:
                self.get_logger().info(f"{kind} refused ({ErrorCode(code).name}): {message}")
        if session is not None:
            response.position = session.engine.position if position is None else position
        ms = (time.perf_counter() - start) * 1e3
        response.success, response.error_code, response.message, response.latency_ms = code == 0, code, message, ms
        self._latencies.add(kind, ms)
        if kind != "list":
            self._publish_event(kind, info, response)
            self._dirty.set()
        self._report_journal(session)
        return response

    def _report_journal(self, session: Session | None) -> None:
        if session is not None and session.journal_failure:
            self.get_logger().error(f"journal stopped: {session.journal_failure}; the node keeps serving")
            session.journal_failure = ""

    @property
    def serving(self) -> bool:
        return self._active and self.session is not None

    def generating(self) -> bool:
        """Whether a generate goal is running (a policy step would interleave with its tokens)."""
        return self._generation.locked()

    def _operation(self, kind: str, request: Any, session: Session) -> Applied:
        return session.apply(requested(kind, request, self.get_parameter("default_tier").value))

    def _snapshot(self, request: Snapshot.Request, response: Snapshot.Response) -> Snapshot.Response:
        def call(session: Session):
            applied = self._operation(SNAPSHOT, request, session)
            info, rid = self._fill(response, applied.value), request.request_id
            if applied.repeat:
                return info, f"repeat of request_id {rid!r}: same capsule", info.position
            # The caller's trace id goes back in the answer and the event, and to the log.
            return info, f"ok (request_id {shown(rid)})" if rid else "", None

        return self._serve(SNAPSHOT, response, call)

    def _restore(self, request: Restore.Request, response: Restore.Response) -> Restore.Response:
        return self._serve(RESTORE, response, lambda session: (
            self._fill(response, self._operation(RESTORE, request, session).value), "", None))

    def _fork(self, request: Fork.Request, response: Fork.Response) -> Fork.Response:
        # A fork of the live state is a snapshot (see Engine.fork): it goes to the tier a
        # Snapshot with no tier goes to. A fork of a capsule shares its bytes, in its tier.
        def call(session: Session):
            info = self._operation(FORK, request, session).value
            response.source_id = info.parent if request.source_id else ""   # an id, also when named
            return self._fill(response, info), "", None

        return self._serve(FORK, response, call)

    def _rollback(self, request: Rollback.Request, response: Rollback.Response) -> Rollback.Response:
        def call(session: Session):
            _, response.capsule_id = self._operation(ROLLBACK, request, session).value
            return None, "", None

        return self._serve(ROLLBACK, response, call)

    def _list(self, request: ListCapsules.Request, response: ListCapsules.Response) -> ListCapsules.Response:
        def call(session: Session):
            response.capsules = [info_msg(i) for i in session.list(request.tier)]
            return None, "", None

        return self._serve("list", response, call)

    def _drop(self, request: DropCapsule.Request, response: DropCapsule.Response) -> DropCapsule.Response:
        def call(session: Session):
            info = self._operation(DROP, request, session).value
            response.capsule_id = info.id
            return info, "", None

        return self._serve(DROP, response, call)

    @staticmethod
    def _fill(response: Any, info: CapsuleInfo) -> CapsuleInfo:
        response.capsule_id = info.id
        response.capsule = info_msg(info)
        return info

    # ---- generate action -----------------------------------------------------------------------
    def _execute_generate(self, goal_handle) -> Generate.Result:
        self._record("~/generate/goal", goal_handle.request)
        result = self._generate(goal_handle)
        self._record("~/generate/result", result)
        return result

    def _generate(self, goal_handle) -> Generate.Result:
        result = Generate.Result()
        try:
            if not self._wait_for_turn(goal_handle):   # nothing was committed
                result.message = "canceled while it waited for the goal before it"
                result.position = self.engine.position if self.engine is not None else 0
                return self._finish_goal(goal_handle, result, None)
        except FlashRTError as exc:
            return self._finish_goal(goal_handle, result, exc)
        try:
            session = self.session
            if not self._active or session is None:
                raise NotActive(f"node is {self._label}, not active")
            return self._finish_goal(goal_handle, result, run_generation(self, session, goal_handle, result))
        except Exception as exc:
            return self._finish_goal(goal_handle, result, exc)
        finally:
            self._generation.release()
            self._dirty.set()

    def _wait_for_turn(self, goal_handle) -> bool:
        """Goals run one at a time, and one waits at most behind the goal
        running (a behaviour tree's re-run behind the goal it canceled): Busy for a goal beyond
        that, NotActive if the node leaves the active state meanwhile. True: this goal's turn
        (``_generation`` is held); False: it was canceled while it waited."""
        with self._queue_lock:
            if self._generation.acquire(blocking=False):
                return True
            if self._waiting_goals >= MAX_WAITING_GOALS:
                raise Busy("a generate goal is running and another waits for it; send again once one ends")
            self._waiting_goals += 1
        try:
            while not self._generation.acquire(timeout=_DIRTY_POLL_S):
                if goal_handle.is_cancel_requested:
                    return False
                if not self.context.ok() or not self._active:
                    raise NotActive(f"node is {self._label}, not active")
            return True
        finally:
            with self._queue_lock:
                self._waiting_goals -= 1

    def _finish_goal(self, goal_handle, result: Generate.Result, exc: BaseException | None) -> Generate.Result:
        if exc is None:
            result.success, result.error_code, result.message = True, 0, result.message or "ok"
            if goal_handle.is_cancel_requested:
                goal_handle.canceled()
            else:
                goal_handle.succeed()
            return result
        code, message = outcome(exc)
        # A SIGTERM: the feedback it streamed met a dead context, or (Kilted) the shutdown
        # destroys the node, and with it the action server, under the running goal.
        stopping = not self.context.ok() or self._generate_server is None
        if stopping:
            self.get_logger().info(f"generate stopped by shutdown: {message}")
        elif code == ErrorCode.INTERNAL:
            self.get_logger().error(f"generate failed: {message}\n{traceback.format_exc()}")
        result.success, result.error_code, result.message = False, code, message
        if self.engine is not None:
            result.position = self.engine.position
        try:
            goal_handle.abort()
        except Exception:
            if not stopping:
                raise
        return result

    # ---- policy topics (PolicyIO) -------------------------------------------------------------------
    def _policy_stepped(self) -> None:
        self._counters["policy_steps"] += 1
        self._dirty.set()   # "on change" status: sent within the poll interval, not per step
        self._report_journal(self.session)

    def _observation_rejected(self) -> None:
        self._counters["rejected_observations"] += 1

    def _context_full(self, why: str) -> None:
        """Said once per filling: the steps that follow are refused alike until something frees room."""
        self.get_logger().error(f"policy: {why}; steps are refused with CONTEXT_FULL until a restore, rollback "
                                "or new goal frees positions")
        session = self.session
        self._publish_event("context_full", None, _Unasked(
            position=session.engine.position if session is not None else 0, message=why, success=False,
            error_code=int(ErrorCode.CONTEXT_FULL)))
        self._dirty.set()

    # ---- the journal bag ---------------------------------------------------------------------------
    def _record(self, topic: str, msg: Any) -> None:
        """``msg`` into the journal bag, if one records, on ``topic`` as this node resolves it."""
        bag = self._bag
        if bag is not None:
            bag.message(self.resolve_topic_name(topic), msg)

    def _record_service(self, srv: Any, name: str, request: Any, response: Any) -> None:
        bag = self._bag
        if bag is not None:
            bag.service_event(srv, name, request, response)

    # ---- events and telemetry -----------------------------------------------------------------------
    def _on_store_event(self, kind: str, info: CapsuleInfo) -> None:
        """What happens inside other operations, or after them, is announced on its own:
        spills, evictions, and a snapshot's digest once the background hash is done (the
        answer to the Snapshot or Fork carried an empty one)."""
        messages = {"spill": f"capsule {info.id} moved to {info.tier}", "evict": f"capsule {info.id} evicted",
                    "digest": f"capsule {info.id} digest {info.digest[:16]}..."}
        if kind not in messages or not self.context.ok():   # after shutdown: the engine's close
            return                                          # still finishes digests, nobody hears them
        engine = self.engine
        msg = CapsuleEvent(kind=kind, capsule=info_msg(info), success=True, error_code=0,
                           position=engine.position if engine is not None else 0, message=messages[kind])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._events.publish(msg)
        self._record("~/events", msg)

    def _publish_event(self, kind: str, info: CapsuleInfo | None, response: Any) -> None:
        try:
            msg = CapsuleEvent(kind=kind, capsule=info_msg(info), position=response.position,
                               latency_ms=response.latency_ms, success=response.success,
                               error_code=response.error_code, message=response.message)
            msg.header.stamp = self.get_clock().now().to_msg()
            self._events.publish(msg)
            self._record("~/events", msg)
        except Exception:  # the answer is what matters: an event that cannot go out must not cost it
            if not self.context.ok():   # a shutdown landed first: nobody is left to hear it
                return
            self.get_logger().error(f"{kind} event not published:\n{traceback.format_exc()}")

    def _poll(self) -> None:
        """Leases that have run out end here, the store's events and "on change" status go out."""
        session = self.session
        if session is not None:
            try:
                for kind, info in session.engine.capsules.take_events():
                    self._on_store_event(kind, info)
            except Exception:   # like the status: an event that cannot go out must not stop the executor
                if self.context.ok():
                    self.get_logger().error(f"capsule event not published:\n{traceback.format_exc()}",
                                            throttle_duration_sec=5.0)
        if session is not None and self._active:
            try:
                for info in session.expire():
                    self._publish_event("drop", info, _Unasked(position=session.engine.position,
                                                                   message=f"lease of capsule {info.id} ended"))
            except Exception:   # like the status: an engine fault must not stop the executor
                if self.context.ok():
                    self.get_logger().error(f"lease expiry failed:\n{traceback.format_exc()}",
                                            throttle_duration_sec=5.0)
            self._report_journal(session)
        if self._dirty.is_set():
            self._publish_status()

    def _publish_status(self) -> None:
        try:
            self._publish_status_now()
        except Exception:   # an engine fault (a sticky CUDA error, say) must not stop the executor
            if not self.context.ok():   # a SIGTERM landed while the timer ran: not a fault
                return
            self._counters["status_failures"] += 1
            self.get_logger().error(f"status not published:\n{traceback.format_exc()}", throttle_duration_sec=5.0)

    def _publish_status_now(self) -> None:
        self._dirty.clear()
        session = self.session
        now = self.get_clock().now().to_msg()
        if session is None:
            status = status_msg(self._label, None, "", now)
        else:
            with session.engine.lock:   # one moment for every field: the digest is the position's
                # Not while a goal commits tokens: hashing the state every poll period would cost
                # it decode steps. Its end marks the status dirty, and the digest follows then.
                digest = "" if self._generation.locked() else session.status_digest()
                status = status_msg(self._label, session.engine, digest, now)
        self._status_pub.publish(status)
        counters = {**self._counters, "service_failures": self._capsule_services.failures}
        self._diagnostics.publish(diagnostics_msg(self.get_name(), status, self._latencies, counters, now))

    def destroy_node(self) -> None:
        # Also reached from a constructor that failed (Kilted's Node.__init__ destroys
        # itself on a refused parameter), before our own attributes exist. And twice: Kilted's
        # Context.shutdown destroys the nodes it tracks, then the owner's cleanup does, and
        # rclpy's action server raises when destroyed a second time.
        self._active = False
        server, self._generate_server = getattr(self, "_generate_server", None), None
        if server is not None:
            server.destroy()
        services = getattr(self, "_capsule_services", None)
        if services is not None:
            services.stop()
        if hasattr(self, "_bag"):
            self._free()
        super().destroy_node()
