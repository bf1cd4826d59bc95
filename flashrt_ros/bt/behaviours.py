"""py_trees behaviours that call the flashrt node's capsule services and generate action.

Every behaviour is non-blocking: the first tick sends the request and returns
RUNNING; later ticks look at the future. It returns FAILURE when the answer
says ``success=false`` (the error code, its name and the message go to the
blackboard under ``error_key`` and to the log), when no answer arrives within
``timeout_s``, or when the server is not there. An answer that arrives after a
timeout or a halt belongs to an abandoned attempt and is ignored.

Snapshot sends a ``request_id``. It is kept when the attempt times out, so the
retry asks for the same snapshot and the node answers with the same capsule;
it is cleared once an answer has been read, and when the behaviour is halted:
a halted branch that runs again later wants the state of then. Snapshot and
Fork ask for a lease (``lease_s``): the node drops the capsule once that long
has passed since it was made or last used, so what an abandoned attempt made
goes by itself, and no behaviour keeps a list of others' leftovers. A capsule
meant to outlive its lease takes ``lease_s=0``.
Restore and Drop are idempotent by nature; Fork and Rollback(steps) are not
(a halt after the node applied them and a retry apply them twice): retry
those only from a state you restore first.

The node passed in must be spun by an executor in another thread (the tree is
ticked from this one).
"""
from __future__ import annotations

import numbers
import threading
import time
import uuid
from typing import Any

import py_trees
from py_trees.common import Access, Status
from action_msgs.msg import GoalStatus
from rclpy.action import ActionClient

from ..action import Generate as GenerateAction
from ..errors import ErrorCode
from ..srv import DropCapsule as DropSrv
from ..srv import Fork as ForkSrv
from ..srv import Restore as RestoreSrv
from ..srv import Rollback as RollbackSrv
from ..srv import Snapshot as SnapshotSrv


class _ActionClient(ActionClient):
    """rclpy's ActionClient, safe to create while an executor spins its node.

    Kilted's rclpy (9.1.2) adds the client to its node before it makes the
    client's lock, so an executor already spinning the node can ask the half-built
    client for its entities and die of an AttributeError (seen in CI). The lock
    made first closes that window; rclpy replaces it with its own before the
    client is returned, while nothing else uses it yet.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lock = threading.Lock()
        super().__init__(*args, **kwargs)


TIMEOUT = -1          # error_code written for a call that got no answer in time
NO_SERVER = -2        # error_code written when the service or action server is absent
CANCELED = -3         # error_code written when another client canceled the goal


class _Call(py_trees.behaviour.Behaviour):
    """Shared machinery: send on initialise, poll on update, abandon on halt."""

    def __init__(self, name: str, node: Any, server: str, timeout_s: float, error_key: str,
                 wait_for_server_s: float = 5.0) -> None:
        super().__init__(name)
        self.node, self.server, self.timeout_s, self.error_key = node, server.rstrip("/"), timeout_s, error_key
        self.wait_for_server_s = wait_for_server_s
        self.bb = self.attach_blackboard_client(name=name)
        self.bb.register_key(error_key, access=Access.WRITE)
        self._future = None
        self._deadline = 0.0
        self._abandoned: set = set()   # futures dropped unanswered: their answers are late
        self.late_answers = 0

    def setup(self, **kwargs: Any) -> None:
        """Give discovery time to find the server (up to ``wait_for_server_s``); a server
        still absent then is reported as NO_SERVER when the behaviour runs, not here.

        ``deadline`` (a ``time.monotonic()`` value, passed through ``tree.setup``) bounds
        the waits of all behaviours together: py_trees keeps ``timeout`` to itself, and
        twenty behaviours waiting in turn for an absent server would outlast it.
        """
        seconds = self.wait_for_server_s
        if kwargs.get("deadline") is not None:
            seconds = max(0.0, min(seconds, float(kwargs["deadline"]) - time.monotonic()))
        self._wait_for_server(seconds)

    def _wait_for_server(self, seconds: float) -> None:
        raise NotImplementedError

    def _key(self, key: str, access: Access) -> None:
        self.bb.register_key(key, access=access)

    def _send(self, future) -> None:
        self._future = future
        self._deadline = time.monotonic() + self.timeout_s
        future.add_done_callback(self._maybe_late)

    def _maybe_late(self, future) -> None:
        # Only a future this behaviour dropped is late. "Not the current one" is not
        # enough: done callbacks run on the executor's thread, possibly after update()
        # has already taken the answer and moved on to the next future.
        try:
            self._abandoned.remove(future)   # atomic: this or _abandon() handles it, once
        except KeyError:
            return
        self.late_answers += 1
        self.logger.debug(f"{self.name}: ignored an answer to an abandoned attempt")
        self._late(future)

    def _late(self, future) -> None:
        """A late answer arrived (hook for calls that must undo it)."""

    def _abandon(self) -> None:
        """Drop the call in flight; its answer, whenever it comes, is ignored."""
        future, self._future = self._future, None
        if future is not None:
            self._abandoned.add(future)
            if future.done():  # answered before we dropped it: its callback may have run already
                self._maybe_late(future)

    def _fail(self, code: int, message: str) -> Status:
        name = ({TIMEOUT: "TIMEOUT", NO_SERVER: "NO_SERVER", CANCELED: "CANCELED"}.get(code)
                or (ErrorCode(code).name if code in ErrorCode._value2member_map_ else f"code {code}"))
        self.bb.set(self.error_key, {"behaviour": self.name, "code": code, "name": name, "message": message})
        self.feedback_message = f"{name}: {message}"
        self.logger.warning(f"{self.name} failed: {name}: {message}")
        return Status.FAILURE

    def _poll(self):
        """The finished future's result, None while RUNNING, or a Status to return at once."""
        if self._future is None:
            return Status.FAILURE
        if not self._future.done():
            if time.monotonic() > self._deadline:
                self._abandon()
                return self._timed_out()
            return None
        result = self._future.result()
        self._future = None
        return result

    def _timed_out(self) -> Status:
        return self._fail(TIMEOUT, f"no answer within {self.timeout_s:g} s")

    def terminate(self, new_status: Status) -> None:
        if new_status == Status.INVALID and self._future is not None:
            self.logger.debug(f"{self.name}: halted with a call in flight")
            self._abandon()


class _ServiceCall(_Call):
    srv_type: Any = None
    service = ""

    def __init__(self, name: str, node: Any, server: str = "/flashrt", timeout_s: float = 5.0,
                 error_key: str = "flashrt_error", wait_for_server_s: float = 5.0) -> None:
        super().__init__(name, node, server, timeout_s, error_key, wait_for_server_s)
        self.client = node.create_client(self.srv_type, f"{self.server}/{self.service}")
        self._bad_request = ""

    def _wait_for_server(self, seconds: float) -> None:
        self.client.wait_for_service(timeout_sec=seconds)

    def request(self) -> Any:
        raise NotImplementedError

    def _read(self, key: str, kind: type) -> Any:
        """A blackboard value for a request field, of the field's type. Checked here: rclpy
        does not check field types by default, and a wrong one aborts the process when the
        request is serialised."""
        value = self.bb.get(key)   # KeyError when nobody has set it
        if isinstance(value, bool) or not isinstance(value, kind):
            raise TypeError(f"blackboard key {key!r} holds {type(value).__name__} {value!r:.40}, "
                            f"not {kind.__name__}")
        return value

    def on_success(self, response: Any) -> None:
        """Write the response's outputs to the blackboard."""

    def initialise(self) -> None:
        self._future, self._bad_request = None, ""
        if not self.client.service_is_ready():
            return
        try:
            request = self.request()
            future = self.client.call_async(request)
        except Exception as exc:   # noqa: BLE001 (what a bad field raises depends on rclpy)
            # A blackboard key nobody set, set to the wrong type, or to a value its field cannot
            # hold (an int past int64, a string that is not UTF-8): a failure of this behaviour,
            # not an exception out of tick() (or an abort in rclpy, see _read).
            self._bad_request = f"cannot build the {self.service} request: {type(exc).__name__}: {exc}"
            return
        self._send(future)

    def update(self) -> Status:
        if self._bad_request:
            return self._fail(ErrorCode.INVALID_ARGUMENT, self._bad_request)
        if self._future is None and not self.client.service_is_ready():
            return self._fail(NO_SERVER, f"service {self.client.srv_name} is not available")
        response = self._poll()
        if response is None:
            return Status.RUNNING
        if isinstance(response, Status):
            return response
        self.answered(response)
        if not response.success:
            return self._fail(response.error_code, response.message)
        self.on_success(response)
        self.feedback_message = f"ok ({response.latency_ms:.2f} ms)"
        return Status.SUCCESS

    def answered(self, response: Any) -> None:
        """Any answer, success or not, ends the attempt."""


LEASE_S = 600.0   # what Snapshot and Fork ask for unless told otherwise: ten minutes after the last use


class Snapshot(_ServiceCall):
    """Snapshot the live state; the capsule id goes to ``capsule_key`` (its position to ``position_key``).

    An attempt that timed out keeps its ``request_id``, so that the next run asks for the
    same capsule; a halt gives that up (the node drops what the abandoned attempt made when
    its lease ends)."""

    srv_type, service = SnapshotSrv, "snapshot"

    def __init__(self, name: str, node: Any, capsule_key: str, capsule_name: str = "", tier: str = "",
                 pin: bool = False, position_key: str | None = None, lease_s: float = LEASE_S,
                 **kwargs: Any) -> None:
        super().__init__(name, node, **kwargs)
        self.capsule_key, self.capsule_name, self.tier, self.pin = capsule_key, capsule_name, tier, pin
        self.position_key, self.lease_s = position_key, float(lease_s)
        self._key(capsule_key, Access.WRITE)
        if position_key:
            self._key(position_key, Access.WRITE)
        self.request_id = ""

    def request(self) -> Any:
        if not self.request_id:
            self.request_id = f"{self.name}-{uuid.uuid4().hex[:12]}"
        return self.srv_type.Request(name=self.capsule_name, tier=self.tier, pin=self.pin,
                                     request_id=self.request_id, lease_s=self.lease_s)

    def answered(self, response: Any) -> None:
        self.request_id = ""

    def terminate(self, new_status: Status) -> None:
        if new_status == Status.INVALID:
            self.request_id = ""
        super().terminate(new_status)

    def on_success(self, response: Any) -> None:
        self.bb.set(self.capsule_key, response.capsule_id)
        if self.position_key:
            self.bb.set(self.position_key, response.position)


class Restore(_ServiceCall):
    """Make the capsule named by ``capsule_key`` the live state."""

    srv_type, service = RestoreSrv, "restore"

    def __init__(self, name: str, node: Any, capsule_key: str, verify: bool = False, **kwargs: Any) -> None:
        super().__init__(name, node, **kwargs)
        self.capsule_key, self.verify = capsule_key, verify
        self._key(capsule_key, Access.READ)

    def request(self) -> Any:
        return self.srv_type.Request(capsule_id=self._read(self.capsule_key, str), verify=self.verify)


class Fork(_ServiceCall):
    """Fork ``source_key``'s capsule (or the live state when None) into ``capsule_key``.

    A fork that answers after its attempt was abandoned (a timeout, a halt) is left to its
    lease: a run again makes a new one."""

    srv_type, service = ForkSrv, "fork"

    def __init__(self, name: str, node: Any, capsule_key: str, source_key: str | None = None,
                 capsule_name: str = "", lease_s: float = LEASE_S, **kwargs: Any) -> None:
        super().__init__(name, node, **kwargs)
        self.capsule_key, self.source_key, self.capsule_name = capsule_key, source_key, capsule_name
        self.lease_s = float(lease_s)
        self._key(capsule_key, Access.WRITE)
        if source_key:
            self._key(source_key, Access.READ)

    def request(self) -> Any:
        source = self._read(self.source_key, str) if self.source_key else ""
        return self.srv_type.Request(source_id=source, name=self.capsule_name, lease_s=self.lease_s)

    def on_success(self, response: Any) -> None:
        self.bb.set(self.capsule_key, response.capsule_id)


class Rollback(_ServiceCall):
    """Go back ``steps`` boundaries, or to the position in ``to_position_key``."""

    srv_type, service = RollbackSrv, "rollback"

    def __init__(self, name: str, node: Any, steps: int = 1, to_position_key: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(name, node, **kwargs)
        self.steps, self.to_position_key = steps, to_position_key
        if to_position_key:
            self._key(to_position_key, Access.READ)

    def request(self) -> Any:
        to = int(self._read(self.to_position_key, numbers.Integral)) if self.to_position_key else -1
        return self.srv_type.Request(steps=self.steps, to_position=to)


class Drop(_ServiceCall):
    """Drop the capsule named by ``capsule_key``."""

    srv_type, service = DropSrv, "drop_capsule"

    def __init__(self, name: str, node: Any, capsule_key: str, if_set: bool = False, **kwargs: Any) -> None:
        """``if_set``: succeed without a call when ``capsule_key`` holds nothing (cleanup
        after a branch that failed before it made the capsule)."""
        super().__init__(name, node, **kwargs)
        self.capsule_key, self.if_set = capsule_key, if_set
        self._key(capsule_key, Access.READ)

    def _nothing_to_drop(self) -> bool:
        return self.if_set and not self.bb.exists(self.capsule_key)

    def initialise(self) -> None:
        if self._nothing_to_drop():
            self._future, self._bad_request = None, ""
            return
        super().initialise()

    def update(self) -> Status:
        if self._future is None and self._nothing_to_drop():
            self.feedback_message = f"nothing in {self.capsule_key}"
            return Status.SUCCESS
        return super().update()

    def request(self) -> Any:
        return self.srv_type.Request(capsule_id=self._read(self.capsule_key, str))


class Generate(_Call):
    """Run the generate action; the result's tokens and text go to ``result_key``.

    ``initialise`` sends the goal; ``update`` polls for its acceptance, then for its result. A
    halt or a timeout cancels the goal (the node stops it at the next committed boundary). A
    run that starts meanwhile sends its goal at once: the node queues it behind the canceled
    one (one goal waits at most; a goal beyond that is refused BUSY). A goal canceled by
    another client is a FAILURE (CANCELED), not a short result. ``temperature``, ``top_k``,
    ``top_p`` and ``seed`` are the goal's (0, 0, 1 and -1: greedy, the state's own seed; a
    temperature of -1 samples as the checkpoint's generation_config.json does).
    """

    def __init__(self, name: str, node: Any, result_key: str, prompt: str = "", max_new_tokens: int = 16,
                 server: str = "/flashrt", timeout_s: float = 30.0, error_key: str = "flashrt_error",
                 wait_for_server_s: float = 5.0, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = -1) -> None:
        super().__init__(name, node, server, timeout_s, error_key, wait_for_server_s)
        self.client = _ActionClient(node, GenerateAction, f"{self.server}/generate")
        self.result_key, self.prompt, self.max_new_tokens = result_key, prompt, max_new_tokens
        self.temperature, self.top_k, self.top_p, self.seed = float(temperature), int(top_k), float(top_p), int(seed)
        self._key(result_key, Access.WRITE)
        self._goal = None   # the accepted goal, while its result is awaited

    def _wait_for_server(self, seconds: float) -> None:
        self.client.wait_for_server(timeout_sec=seconds)

    def initialise(self) -> None:
        self._future, self._goal = None, None
        if self.client.server_is_ready():
            self._send(self.client.send_goal_async(GenerateAction.Goal(
                prompt=self.prompt, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                top_k=self.top_k, top_p=self.top_p, seed=self.seed)))

    def update(self) -> Status:
        if self._future is None and self._goal is None:
            return self._fail(NO_SERVER, "generate action server is not available")
        answer = self._poll()
        if answer is None:
            return Status.RUNNING
        if isinstance(answer, Status):
            return answer
        if self._goal is None:  # the goal handle arrived: now wait for the result
            if not answer.accepted:
                return self._fail(ErrorCode.BUSY, "goal rejected")
            self._goal, deadline = answer, self._deadline
            self._send(answer.get_result_async())
            self._deadline = deadline   # one timeout for the whole goal
            return Status.RUNNING
        self._goal = None
        result = answer.result
        if answer.status == GoalStatus.STATUS_CANCELED:
            return self._fail(CANCELED, f"goal canceled after {len(result.tokens)} tokens")
        if not result.success or answer.status != GoalStatus.STATUS_SUCCEEDED:
            return self._fail(result.error_code or ErrorCode.INTERNAL, result.message)
        self.bb.set(self.result_key, {"tokens": list(result.tokens), "text": result.text,
                                      "ttft_ms": result.ttft_ms, "position": result.position})
        return Status.SUCCESS

    def _timed_out(self) -> Status:
        self._cancel()
        return super()._timed_out()

    def _late(self, future) -> None:
        handle = None if future.cancelled() or future.exception() is not None else future.result()
        if getattr(handle, "accepted", False) and hasattr(handle, "cancel_goal_async"):
            handle.cancel_goal_async()  # a goal accepted after its behaviour was halted must not run on

    def terminate(self, new_status: Status) -> None:
        if new_status == Status.INVALID:
            self._cancel()
        super().terminate(new_status)

    def _cancel(self) -> None:
        if self._goal is not None:
            self._goal.cancel_goal_async()
            self._goal = None
