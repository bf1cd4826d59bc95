"""Replay of a recording against a running flashrt_node over DDS (``flashrt-replay --live``).

The player plays the recording's inputs into the node, as ``ros2 bag play`` would: each step's
ee_pose and joint state, the very bytes recorded, on the node's topics, and each capsule call
as a request to its service. It waits for the node's answer to each (the action, the response)
before it sends the next, so the node commits them in the recorded order, and judges what
comes back with the verdicts of an in-process replay (``replay.journal.judge_on``).

Only what DDS shows is judged: actions, outcomes, error codes, capsule ids and the positions
the services answer. State digests are not published, and Generate goals (which rosbag2 cannot
record, Jazzy introspecting no actions) are not played.

The node must start where the recorded one did: the same model and layout (its own
``~/session`` record says which; its platform decides whether exact or portable applies), with
the capsules the recorded one found at start, and no calls or steps before the first recorded
one (the player does not check that: a node that served before answers at other positions).

The node takes the latest pose when a joint state arrives, and DDS orders messages per topic
only: the player sends a step's pose, waits until the node's reader has acknowledged it and for
``settle_s`` more, so that the node has taken it before the joint state that follows.
"""
from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import rclpy
from geometry_msgs.msg import PoseStamped
from rclpy.context import Context
from rclpy.duration import Duration
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from trajectory_msgs.msg import JointTrajectoryPoint

from ..errors import ErrorCode, FlashRTError, InvalidArgument
from ..msg import JournalSession
from ..replay.bag import SESSION_TYPE, session_of_message
from ..replay.types import deserialize
from ..serving import operations as ops
from ..serving.journal import DROP, FORK, RESTORE, ROLLBACK, SNAPSHOT, STEP, Entry
from ..serving.record import SessionRecord
from ..srv import DropCapsule, Fork, ListCapsules, Restore, Rollback, Snapshot

# The calls a live replay plays (besides steps): kind -> (service under the node, type).
PLAYED_CALLS = {SNAPSHOT: ("snapshot", Snapshot), FORK: ("fork", Fork), RESTORE: ("restore", Restore),
                ROLLBACK: ("rollback", Rollback), DROP: ("drop_capsule", DropCapsule)}
_LATCHED = QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL, reliability=ReliabilityPolicy.RELIABLE)


class Refused(FlashRTError):
    """The live node answered with an error code (judged like an engine's refusal)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code) if code in ErrorCode._value2member_map_ else code


class Unanswered(Exception):
    """The live node gave no answer (a dropped observation, a service that hung): a real
    difference, which ends the replay there. Not a FlashRTError: no recorded code matches it."""


class Unplayable(Exception):
    """The recording holds something the player cannot send (the replay cannot go on)."""


class LiveNode:
    """A ``replay.journal.Target`` that is a flashrt_node reached over DDS."""

    def __init__(self, recorded: SessionRecord, inputs: dict[int, tuple[bytes, bytes]],
                 timeout_s: float = 30.0, settle_s: float = 0.02) -> None:
        self._inputs, self._timeout, self._settle = inputs, timeout_s, settle_s
        self._context = Context()
        rclpy.init(context=self._context)
        self._node = rclpy.create_node(f"flashrt_replay_{time.monotonic_ns() % 10**9}", context=self._context)
        name = recorded.node
        self._pose = self._node.create_publisher(PoseStamped, recorded.ee_pose_topic, 10)
        self._joints = self._node.create_publisher(JointState, recorded.joint_states_topic, 10)
        self._actions: list[bytes] = []
        self._arrived = threading.Condition()
        self._action_topic = recorded.action_topic
        self._node.create_subscription(JointTrajectoryPoint, self._action_topic, self._on_action, 100)
        self._session: SessionRecord | str | None = None   # a str: why it could not be read
        self._node.create_subscription(JournalSession, f"{name}/session", self._on_session, _LATCHED, raw=True)
        self._clients = {kind: self._node.create_client(srv, f"{name}/{service}")
                         for kind, (service, srv) in PLAYED_CALLS.items()}
        self._list = self._node.create_client(ListCapsules, f"{name}/list_capsules")
        self._executor = SingleThreadedExecutor(context=self._context)
        self._executor.add_node(self._node)
        self._thread = threading.Thread(target=self._executor.spin, name="live-replay", daemon=True)
        self._thread.start()

    # ---- the node's side ------------------------------------------------------------------------------
    def _on_action(self, msg: JointTrajectoryPoint) -> None:
        with self._arrived:
            self._actions.append(np.asarray(msg.positions, dtype=np.float64).astype("<f4").tobytes())
            self._arrived.notify_all()

    def _on_session(self, raw: bytes) -> None:
        try:
            session = session_of_message(deserialize(raw, SESSION_TYPE))
        except Exception as exc:   # (an exception out of a callback would end the spin thread)
            session = f"{type(exc).__name__}: {exc}"   # why it cannot be read
        with self._arrived:
            self._session = session
            self._arrived.notify_all()

    def connect(self) -> dict[str, Any]:
        """The live node's session record, once its services answer and it is active;
        InvalidArgument when it does not come up within the timeout."""
        deadline = time.monotonic() + self._timeout
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._session is not None, self._timeout):
                raise InvalidArgument(f"no session record on {self._node.resolve_topic_name('~')}: is a flashrt_node "
                                      f"running in this ROS domain, with the recorded node name?")
        if isinstance(self._session, str):
            raise InvalidArgument(f"its session record cannot be read ({self._session})")
        for client in (*self._clients.values(), self._list):
            if not client.wait_for_service(timeout_sec=max(0.1, deadline - time.monotonic())):
                raise InvalidArgument(f"the node's {client.srv_name} service did not come up")
        # Messages sent before the node's readers match are lost (and an unmatched publisher's
        # wait_for_all_acked returns at once).
        while self._pose.get_subscription_count() == 0 or self._joints.get_subscription_count() == 0 \
                or self._node.count_publishers(self._action_topic) == 0:
            if time.monotonic() > deadline:
                raise InvalidArgument("its policy topics did not match this player's (is it in policy mode, "
                                      "with the recorded topic names?)")
            time.sleep(0.01)
        while True:   # autostart: the services exist before activation ends
            try:
                answer = self._call(self._list, ListCapsules.Request())
            except Unanswered as exc:
                raise InvalidArgument(str(exc)) from None
            if answer.error_code != ErrorCode.NOT_ACTIVE:
                return self._session
            if time.monotonic() > deadline:
                raise InvalidArgument("the node did not become active")
            time.sleep(0.1)

    def close(self) -> None:
        self._executor.shutdown(timeout_sec=5)
        self._thread.join(5)
        self._node.destroy_node()
        self._context.try_shutdown()

    # ---- Target -------------------------------------------------------------------------------------
    def apply(self, entry: Entry, ids: dict[str, str]) -> dict[str, Any]:
        if entry.kind == STEP:
            return {"action": self._step(entry).hex()}
        if entry.kind not in PLAYED_CALLS:
            raise Unplayable(f"message seq={entry.seq} ({entry.kind}) cannot be played into a live node")
        _, srv = PLAYED_CALLS[entry.kind]
        request = _service_request(srv, ops.operation_of(entry.kind, entry.request), ids)
        response = self._call(self._clients[entry.kind], request)
        if not response.success:
            raise Refused(response.error_code, response.message)
        produced: dict[str, Any] = {"position": int(response.position)}
        if entry.kind in (SNAPSHOT, FORK):
            produced["capsule_id"] = response.capsule_id
        return produced

    def state_digest(self) -> str | None:
        return None

    def take_recorded(self, entry: Entry, token: int) -> None:
        raise Unplayable("a live replay plays no tokens")

    # ---- one call, one step -------------------------------------------------------------------------
    def _call(self, client: Any, request: Any) -> Any:
        future = client.call_async(request)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        if not done.wait(self._timeout):
            client.remove_pending_request(future)
            raise Unanswered(f"{client.srv_name}: no answer within {self._timeout:g} s")
        return future.result()

    def _step(self, entry: Entry) -> bytes:
        if entry.seq not in self._inputs:
            raise Unplayable(f"message seq={entry.seq}: a step without the messages it was built from")
        pose, joints = self._inputs[entry.seq]
        with self._arrived:
            seen = len(self._actions)
        self._pose.publish(pose)
        if not self._pose.wait_for_all_acked(Duration(seconds=self._timeout)):
            raise Unanswered(f"the node did not take the ee_pose of step seq={entry.seq}")
        time.sleep(self._settle)
        self._joints.publish(joints)
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._actions) > seen, self._timeout):
                raise Unanswered(f"no action within {self._timeout:g} s for step seq={entry.seq}: the node "
                                       "dropped the observation (its log says why)")
            if len(self._actions) > seen + 1:
                raise Unanswered(f"{len(self._actions) - seen} actions for step seq={entry.seq}: another "
                                       "publisher feeds the node")
            return self._actions[seen]


def _service_request(srv: Any, op: ops.Operation, ids: dict[str, str]) -> Any:
    """The request message that asks ``srv`` for ``op``, capsule ids mapped through ``ids``."""
    def mapped(capsule_id: str) -> str:
        return ids.get(capsule_id, capsule_id)

    if isinstance(op, ops.Snapshot):   # the tier as the client sent it: a repeat is matched by it
        return srv.Request(name=op.name, tier=op.matched[1], pin=op.pin, request_id=op.request_id, lease_s=op.lease_s)
    if isinstance(op, ops.Fork):
        return srv.Request(source_id=mapped(op.source_id), name=op.name, lease_s=op.lease_s)
    if isinstance(op, ops.Restore):
        return srv.Request(capsule_id=mapped(op.capsule_id), verify=op.verify)
    if isinstance(op, ops.Rollback):
        return srv.Request(steps=op.steps, to_position=op.to_position)
    return srv.Request(capsule_id=mapped(op.capsule_id))
