"""The flashrt lifecycle node: a thin adapter from ROS 2 to the engine.

Every decision about state stays in the engine. The node turns requests into
engine calls, exceptions into error codes, and results into responses,
events and telemetry. Each operation runs while holding the engine lock, so
the journal (when one is attached) lists operations in the order they were
committed, even when many clients call at once.

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
from typing import Any, Callable

import torch
from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rclpy._rclpy_pybind11 import RCLError

from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PoseStamped
from sensor_msgs.msg import JointState
from trajectory_msgs.msg import JointTrajectoryPoint

from ..action import Generate
from ..capsule import CapsuleInfo, signing
from ..errors import Busy, ErrorCode, InvalidArgument, NotActive, shown
from ..msg import CapsuleEvent, RuntimeStatus
from ..replay import journal as J
from ..replay.bag import BagWriter
from ..replay.session import session_of
from ..runtime import Engine
from ..runtime.tokenizer import load_tokenizer
from ..snapshot_requests import SnapshotRequests
from ..srv import DropCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot
from . import params
from .convert import info_msg, outcome
from .generation import run_generation
from .observation import build_observation, stamp_gap
from .services import CapsuleServices
from .telemetry import Latencies, diagnostics_msg, status_msg

_STATUS_QOS = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)
_EVENTS_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
_DIRTY_POLL_S = 0.05     # "on change" status goes out within this
_JOURNAL_TEXT = 1024     # longest string a capsule request puts in the journal (valid ones are shorter)


def _capped(request: dict) -> dict:
    """A capsule request as journaled: a string past any valid length (a name is at most 128,
    a request_id 256 characters) is cut, so a megabyte field cannot bloat the bag. Cut, it is
    just as invalid: replay reproduces the same refusal."""
    return {k: v[:_JOURNAL_TEXT] if isinstance(v, str) and len(v) > _JOURNAL_TEXT else v
            for k, v in request.items()}


class FlashRTNode(LifecycleNode):
    """Lifecycle: configure loads the model and allocates the arena, activate serves,
    deactivate stops serving (requests answer NOT_ACTIVE), cleanup frees."""

    def __init__(self, node_name: str = "flashrt", **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        self._answer_invalid_transitions()
        self._status_timer = None
        self.engine: Engine | None = None
        self.add_on_set_parameters_callback(self._on_set_parameters)
        params.declare_all(self)
        self.tokenizer = None
        self.journal: J.Journal | None = None
        self._bag: BagWriter | None = None
        self._configures = 0
        self._label = "unconfigured"
        self._active = False
        self._joint_names: list[str] = []
        self._max_pose_age = float(self.get_parameter("policy.max_pose_age").value)
        self._generation = threading.Lock()
        self._requests = SnapshotRequests()
        self._latest_pose: PoseStamped | None = None
        self._latencies = Latencies()
        self._counters = {"requests": 0, "failed_requests": 0, "policy_steps": 0, "rejected_observations": 0,
                          "status_failures": 0}
        self._version = 0              # bumped by every state change; the status digest is cached per version
        self._digest = (-1, "")
        self._dirty = threading.Event()

        self._action_group = ReentrantCallbackGroup()
        policy = MutuallyExclusiveCallbackGroup()
        self._timer_group = MutuallyExclusiveCallbackGroup()
        self._capsule_services = CapsuleServices(self, (
            (Snapshot, "snapshot", self._snapshot), (Restore, "restore", self._restore), (Fork, "fork", self._fork),
            (Rollback, "rollback", self._rollback), (ListCapsules, "list_capsules", self._list),
            (DropCapsule, "drop_capsule", self._drop)))
        self._generate_server = ActionServer(
            self, Generate, "~/generate", self._execute_generate, goal_callback=lambda _: GoalResponse.ACCEPT,
            cancel_callback=lambda _: CancelResponse.ACCEPT, callback_group=self._action_group)
        self.create_subscription(JointState, "~/joint_states", self._on_joint_state, 10, callback_group=policy)
        self.create_subscription(PoseStamped, "~/ee_pose", self._on_pose, 10, callback_group=policy)
        self._action_pub = self.create_publisher(JointTrajectoryPoint, "~/action", 10)
        self._events = self.create_publisher(CapsuleEvent, "~/events", _EVENTS_QOS)
        self._status_pub = self.create_publisher(RuntimeStatus, "~/status", _STATUS_QOS)
        self._diagnostics = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_timer(_DIRTY_POLL_S, self._publish_if_dirty, callback_group=self._timer_group)
        self._restart_status_timer(self.get_parameter("status_rate").value)
        self._dirty.set()

    # ---- lifecycle -------------------------------------------------------------------------------
    def _answer_invalid_transitions(self) -> None:
        """rclpy's change_state raises on a transition the current state does not have (a
        second configure, say, from a lifecycle manager that retries): the exception left the
        callback, stopped the executor, and the node exited without an answer. It is answered
        success=false instead; the state machine has not moved."""
        service = getattr(self, "_service_change_state", None)
        if service is None:
            return
        change = service.callback

        def answered(request: Any, response: Any) -> Any:
            try:
                return change(request, response)
            except RCLError as exc:
                self.get_logger().warning(f"change_state refused: transition {request.transition.id} "
                                          f"{request.transition.label!r}: {str(exc).splitlines()[0][:200]}")
                response.success = False
                return response

        service.callback = answered

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._configures += 1
        vals = params.values(self)
        reason = params.check_together(vals)
        if reason:
            self.get_logger().error(f"configure refused: {reason}")
            return TransitionCallbackReturn.FAILURE
        try:
            self.engine, self.tokenizer = self._build(vals)
        except Exception as exc:  # any failure to load is a failed transition, never a dead node
            self.get_logger().error(f"configure failed: {outcome(exc)[1]}")
            return TransitionCallbackReturn.FAILURE
        self._joint_names = list(vals["policy.joint_names"])
        self.engine.capsules.subscribe(self._on_store_event)
        if vals["journal_path"]:
            try:
                self._start_journal(vals)
            except Exception as exc:
                self.get_logger().error(f"configure failed: journal_path: {outcome(exc)[1]}")
                self._free()
                return TransitionCallbackReturn.FAILURE
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
                    cuda_graphs=vals["cuda_graphs"], prefill_blocked=vals["prefill_blocked"],
                    decode_native=vals["decode_native"],
                    capsule_dir=vals["capsule_dir"] or None,
                    capsule_key=signing.load_key(vals["capsule_key_file"]) if vals["capsule_key_file"] else None,
                    budgets=params.budgets(vals), spill=vals["spill"], rollback_depth=vals["rollback_depth"])
        engine = Engine.load(vals["model_path"], seed=vals["seed"],
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
        journal = J.Journal(session=session_of(self.engine, vals["model_path"], vals["seed"]))
        self._bag = BagWriter(path, journal.session)
        journal.listeners.append(self._bag)
        self.journal = journal
        self.get_logger().info(f"journal: recording into {path}")

    def _free(self) -> None:
        bag, self._bag, self.journal = self._bag, None, None
        self._latest_pose = None   # a pose from before cleanup must not build the next engine's first observation
        if bag is not None:
            try:
                bag.close()
            except Exception as exc:  # e.g. its folder was deleted: the engine is freed all the same
                self.get_logger().error(f"journal could not be closed: {exc}")
        engine = self.engine
        if engine is None:
            return
        with engine.lock:  # in-flight operations finish first
            self.engine = None
            self._requests.clear()  # request ids name capsules of this engine only
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
                engine = self.engine
                if p.name == "spill" and engine is not None:
                    with engine.lock:   # journaled in order: it decides later refusals and evictions
                        engine.capsules.spill = bool(p.value)
                        self._record(J.SPILL, {"spill": bool(p.value)}, engine, None, {})
                elif p.name == "policy.max_pose_age":
                    self._max_pose_age = float(p.value)
                elif p.name == "status_rate" and hasattr(self, "_timer_group"):  # not while declaring
                    self._restart_status_timer(p.value)
        return result

    def _restart_status_timer(self, rate: float) -> None:
        if self._status_timer is not None:
            self.destroy_timer(self._status_timer)
            self._status_timer = None
        if rate > 0:
            self._status_timer = self.create_timer(1.0 / rate, self._publish_status, callback_group=self._timer_group)

    # ---- services ----------------------------------------------------------------------------------
    def _serve(self, kind: str, response: Any, call: Callable[[Engine], tuple[CapsuleInfo | None, dict]],
               journal: dict | None = None) -> Any:
        """Run ``call`` under the engine lock and fill the common response fields.

        ``call`` returns the capsule involved and the journal outcome fields. No
        exception leaves this method: each becomes success=false with its code.
        """
        self._counters["requests"] += 1
        if journal is not None:
            journal = _capped(journal)
        engine = self.engine
        info, code, message = None, int(ErrorCode.OK), "ok"
        start = time.perf_counter()
        try:
            if not self._active or engine is None:
                raise NotActive(f"node is {self._label}, not active: activate it to serve {kind}")
            with engine.lock:
                try:
                    info, extra = call(engine)
                except Exception as exc:
                    if journal is not None and self.journal is not None:
                        self._record(kind, journal, engine, exc)
                    raise
                if journal is not None and self.journal is not None and not extra.get("repeat"):
                    self._record(kind, journal, engine, None, extra)
                response.position = extra.get("position", engine.position)
            message = extra.get("message", "ok")
        except Exception as exc:
            code, message = outcome(exc)
            self._counters["failed_requests"] += 1
            if code == ErrorCode.INTERNAL:
                self.get_logger().error(f"{kind} failed: {message}\n{traceback.format_exc()}")
            else:
                self.get_logger().info(f"{kind} refused ({ErrorCode(code).name}): {message}")
            if engine is not None:
                response.position = engine.position
        ms = (time.perf_counter() - start) * 1e3
        response.success, response.error_code, response.message, response.latency_ms = code == 0, code, message, ms
        self._latencies.add(kind, ms)
        if kind != "list":
            self._publish_event(kind, info, response)
            self._dirty.set()
        return response

    def _record(self, kind: str, request: dict, engine: Engine, exc: BaseException | None,
                extra: dict | None = None) -> None:
        """Journal one operation. The operation has happened (or been refused) already, so a
        journal that cannot write stops recording, with an error logged, and changes no answer."""
        journal = self.journal
        if journal is None:
            return
        try:
            out = {"error_code": outcome(exc)[0] if exc else 0, "position": engine.position}
            if exc is None:
                out.update({k: v for k, v in (extra or {}).items() if k not in ("message", "repeat", "position")})
                if kind not in (J.PREFILL, J.DECODE, J.STEP, J.SPILL):  # capsule calls: check the whole state
                    out["state_digest"] = engine.state_digest()
            journal.record(kind, request, out)
        except Exception as exc:
            self.journal = None   # a journal with a gap would not replay: stop it here
            self.get_logger().error(f"journal stopped: recording {kind} failed ({exc}); the node keeps serving")

    @property
    def serving(self) -> bool:
        return self._active and self.engine is not None

    def note_state_change(self, engine: Engine, kind: str, request: dict, extra: dict) -> None:
        """Called holding ``engine.lock`` after a prefill, decode or policy step on ``engine``:
        the one that changed, even if a cleanup has since put another in ``self.engine``."""
        self._version += 1
        self._record(kind, request, engine, None, extra)
        self._dirty.set()   # "on change" status: sent within the poll interval, not per step

    def _snapshot(self, request: Snapshot.Request, response: Snapshot.Response) -> Snapshot.Response:
        tier = request.tier or self.get_parameter("default_tier").value
        fields = (request.name, request.tier, request.pin)

        def call(engine: Engine):
            rid = request.request_id
            capsule_id = self._requests.earlier(rid, fields)
            if capsule_id is not None:
                info = engine.capsules.get(capsule_id, wait=False)
                return self._fill(response, info), {"message": f"repeat of request_id {rid!r}: same capsule",
                                                    "capsule_id": info.id, "position": info.position,
                                                    "repeat": True}
            info = engine.snapshot(name=request.name or None, tier=tier, pin=request.pin)
            self._requests.remember(rid, fields, info.id)
            if not rid:
                return self._fill(response, info), {"capsule_id": info.id}
            # The caller's trace id goes back in the answer and the event, and to the log.
            self.get_logger().debug(f"snapshot {info.id} for request_id {shown(rid)}")
            return self._fill(response, info), {"capsule_id": info.id, "message": f"ok (request_id {shown(rid)})"}

        return self._serve(J.SNAPSHOT, response, call, {"name": request.name, "tier": tier, "pin": request.pin,
                                                       "request_id": request.request_id,
                                                       "requested_tier": request.tier})

    def _restore(self, request: Restore.Request, response: Restore.Response) -> Restore.Response:
        def call(engine: Engine):
            info = engine.restore(request.capsule_id, verify=request.verify)
            self._version += 1
            return self._fill(response, info), {}

        return self._serve(J.RESTORE, response, call, {"capsule_id": request.capsule_id, "verify": request.verify})

    def _fork(self, request: Fork.Request, response: Fork.Response) -> Fork.Response:
        # A fork of the live state is a snapshot (see Engine.fork): it goes to the tier a
        # Snapshot with no tier goes to. A fork of a capsule shares its bytes, in its tier.
        tier = "" if request.source_id else self.get_parameter("default_tier").value

        def call(engine: Engine):
            if request.source_id:
                info = engine.fork(request.source_id, name=request.name or None)
            else:
                info = engine.snapshot(name=request.name or None, tier=tier)
            response.source_id = info.parent if request.source_id else ""   # an id, also when named
            return self._fill(response, info), {"capsule_id": info.id}

        return self._serve(J.FORK, response, call, {"source_id": request.source_id, "name": request.name,
                                                   "tier": tier})

    def _rollback(self, request: Rollback.Request, response: Rollback.Response) -> Rollback.Response:
        def call(engine: Engine):
            if request.to_position < -1:
                raise InvalidArgument(f"to_position must be >= 0, or -1 for unused; got {request.to_position}")
            to_position = None if request.to_position == -1 else request.to_position
            engine.rollback(steps=request.steps, to_position=to_position)
            response.capsule_id = engine.rollback_origin if to_position is not None else ""
            self._version += 1
            return None, {}

        return self._serve(J.ROLLBACK, response, call, {"steps": request.steps, "to_position": request.to_position})

    def _list(self, request: ListCapsules.Request, response: ListCapsules.Response) -> ListCapsules.Response:
        def call(engine: Engine):
            response.capsules = [info_msg(i) for i in engine.capsules.list(request.tier)]
            return None, {}

        return self._serve("list", response, call)

    def _drop(self, request: DropCapsule.Request, response: DropCapsule.Response) -> DropCapsule.Response:
        def call(engine: Engine):
            info = engine.capsules.drop(request.capsule_id)
            response.capsule_id = info.id
            return info, {}

        return self._serve(J.DROP, response, call, {"capsule_id": request.capsule_id})

    @staticmethod
    def _fill(response: Any, info: CapsuleInfo) -> CapsuleInfo:
        response.capsule_id = info.id
        response.capsule = info_msg(info)
        return info

    # ---- generate action -----------------------------------------------------------------------
    def _execute_generate(self, goal_handle) -> Generate.Result:
        result = Generate.Result()
        if not self._generation.acquire(blocking=False):
            return self._finish_goal(goal_handle, result, Busy("another generate goal is running; one at a time"))
        try:
            engine = self.engine
            if not self._active or engine is None:
                raise NotActive(f"node is {self._label}, not active")
            return self._finish_goal(goal_handle, result, run_generation(self, engine, goal_handle, result))
        except Exception as exc:
            return self._finish_goal(goal_handle, result, exc)
        finally:
            self._generation.release()
            self._dirty.set()

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

    # ---- policy topics ------------------------------------------------------------------------------
    def _on_pose(self, msg: PoseStamped) -> None:
        self._latest_pose = msg

    def _on_joint_state(self, msg: JointState) -> None:
        engine = self.engine
        if not self._active or engine is None or not engine.config.policy:
            return
        if self._latest_pose is None:
            self._reject("no ~/ee_pose received yet; an observation needs both joint states and the pose")
            return
        gap = stamp_gap(msg, self._latest_pose)
        if self._max_pose_age > 0 and gap is not None and gap > self._max_pose_age:
            # A pose publisher that stopped would otherwise pair every new joint state with
            # where the arm was then.
            self._reject(f"~/ee_pose and ~/joint_states are {gap:.3f} s apart by their stamps "
                         f"(policy.max_pose_age {self._max_pose_age:g} s)")
            return
        try:
            obs = build_observation(self._joint_names, msg, self._latest_pose)
            with engine.lock:
                # Checked under the engine lock, which a goal holds for each token it commits:
                # a step now would land between two of its tokens, inside the text it returns.
                if self._generation.locked():
                    self._reject("a generate goal is running; a step would interleave with its tokens")
                    return
                action = engine.step(obs)
                self.note_state_change(engine, J.STEP, {"observation": obs.tolist()}, {"action": J.action_bytes(action)})
        except InvalidArgument as exc:
            self._reject(str(exc))
            return
        except Exception as exc:  # a bad observation must never take the node down
            self.get_logger().error(f"policy step failed: {outcome(exc)[1]}\n{traceback.format_exc()}")
            return
        self._counters["policy_steps"] += 1
        self._action_pub.publish(JointTrajectoryPoint(positions=action.double().tolist()))

    def _reject(self, why: str) -> None:
        self._counters["rejected_observations"] += 1
        self.get_logger().warning(f"observation dropped: {why}", throttle_duration_sec=5.0)

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

    def _publish_event(self, kind: str, info: CapsuleInfo | None, response: Any) -> None:
        try:
            msg = CapsuleEvent(kind=kind, capsule=info_msg(info), position=response.position,
                               latency_ms=response.latency_ms, success=response.success,
                               error_code=response.error_code, message=response.message)
            msg.header.stamp = self.get_clock().now().to_msg()
            self._events.publish(msg)
        except Exception:  # the answer is what matters: an event that cannot go out must not cost it
            if not self.context.ok():   # a shutdown landed first: nobody is left to hear it
                return
            self.get_logger().error(f"{kind} event not published:\n{traceback.format_exc()}")

    def _publish_if_dirty(self) -> None:
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
        engine = self.engine
        now = self.get_clock().now().to_msg()
        if engine is None:
            status = status_msg(self._label, None, "", now)
        else:
            with engine.lock:   # one moment for every field: the digest is the position's
                # Not while a goal commits tokens: hashing the state every poll period would cost
                # it decode steps. Its end marks the status dirty, and the digest follows then.
                digest = ""
                if not self._generation.locked():
                    if self._digest[0] != (self._version, engine.position):
                        self._digest = ((self._version, engine.position), engine.state_digest())
                    digest = self._digest[1]
                status = status_msg(self._label, engine, digest, now)
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
