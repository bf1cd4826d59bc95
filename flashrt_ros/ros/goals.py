"""The generate action: goals run one at a time, and one more waits its turn.

A behaviour tree that halts a Generate and ticks it again sends its new goal while the
canceled one is still finishing its step; refusing that goal would make every client retry.
So one goal waits behind the one running, and a goal beyond that is refused (BUSY). A waiting
goal canceled before its turn commits nothing and answers the position. See docs/ros.md.

The server lives on a side node (``side_node``) whose executor has a thread for each goal that
may hold one (running, waiting, and one more being refused) and one for the server's own
requests (goals, cancels, results): a cancel is answered while a goal runs, and a goal never
holds up the lifecycle node's timers and transitions.
"""
from __future__ import annotations

import threading
import traceback
from typing import Any

from rclpy.action import ActionServer, CancelResponse, GoalResponse
from rclpy.callback_groups import ReentrantCallbackGroup

from ..action import Generate
from ..errors import Busy, ErrorCode, NotActive
from .convert import outcome
from .generation import run_generation
from .side_node import SideNode

MAX_WAITING_GOALS = 1   # each waiting goal holds an executor thread
_THREADS = 1 + MAX_WAITING_GOALS + 1 + 1   # running, waiting, refused, the server's requests
WAIT_POLL_S = 0.05      # a waiting goal sees its cancel, or the node's deactivation, within this


class GoalQueue:
    """The ~/generate action server of ``node`` (a FlashRTNode), on a side node of its own."""

    def __init__(self, node: Any) -> None:
        self._node = node
        self._running = threading.Lock()   # held by the goal that runs
        self._queue_lock = threading.Lock()
        self.waiting = 0
        self._side = SideNode(node, "generate",
                              lambda trace: node.get_logger().error(f"generate callback failed:\n{trace}"),
                              threads=_THREADS)
        self._server: ActionServer | None = ActionServer(
            self._side.node, Generate, node.resolve_topic_name("~/generate"), self._execute,
            goal_callback=lambda _: GoalResponse.ACCEPT, cancel_callback=lambda _: CancelResponse.ACCEPT,
            callback_group=ReentrantCallbackGroup())
        self._side.start()

    def running(self) -> bool:
        """Whether a goal is running (a policy step now would interleave with its tokens)."""
        return self._running.locked()

    def destroy(self) -> None:
        """Stop taking goals. Safe to call twice (rclpy's action server raises on a second destroy)."""
        server, self._server = self._server, None
        if server is not None:
            self._side.stop_spinning()   # no request reaches the server while it goes
            server.destroy()
            # A goal still running ends at its next token (the node is inactive by now); it
            # finds its server gone and says so.
            self._side.stop(1.0)

    def _execute(self, goal_handle: Any) -> Generate.Result:
        self._node.record("~/generate/goal", goal_handle.request)
        result = self._run(goal_handle)
        self._node.record("~/generate/result", result)
        return result

    def _run(self, goal_handle: Any) -> Generate.Result:
        node, result = self._node, Generate.Result()
        try:
            if not self._wait_for_turn(goal_handle):   # nothing was committed
                engine = node.engine
                result.message = "canceled while it waited for the goal before it"
                result.position = engine.position if engine is not None else 0
                return self._finish(goal_handle, result, None)
        except Exception as exc:
            return self._finish(goal_handle, result, exc)
        try:
            session = node.session
            if session is None or not node.serving:
                raise NotActive(f"node is {node.label}, not active")
            return self._finish(goal_handle, result, run_generation(node, session, goal_handle, result))
        except Exception as exc:
            return self._finish(goal_handle, result, exc)
        finally:
            self._running.release()
            node.report.dirty.set()

    def _wait_for_turn(self, goal_handle: Any) -> bool:
        """True: this goal's turn (``_running`` is held); False: canceled while it waited.
        Busy beyond ``MAX_WAITING_GOALS``; NotActive if the node leaves the active state meanwhile."""
        with self._queue_lock:
            if self._running.acquire(blocking=False):
                return True
            if self.waiting >= MAX_WAITING_GOALS:
                raise Busy("a generate goal is running and another waits for it; send again once one ends")
            self.waiting += 1
        try:
            while not self._running.acquire(timeout=WAIT_POLL_S):
                if goal_handle.is_cancel_requested:
                    return False
                # Serving first: Kilted's shutdown holds the context lock while it destroys the
                # node, and context.ok() waits for that lock.
                if not self._node.serving or not self._node.context.ok():
                    raise NotActive(f"node is {self._node.label}, not active")
            return True
        finally:
            with self._queue_lock:
                self.waiting -= 1

    def _finish(self, goal_handle: Any, result: Generate.Result, exc: BaseException | None) -> Generate.Result:
        node = self._node
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
        stopping = self._server is None or not node.context.ok()   # the server first: as in _wait_for_turn
        if stopping:
            node.get_logger().info(f"generate stopped by shutdown: {message}")
        elif code == ErrorCode.INTERNAL:
            node.get_logger().error(f"generate failed: {message}\n{traceback.format_exc()}")
        result.success, result.error_code, result.message = False, code, message
        engine = node.engine
        if engine is not None:
            result.position = engine.position
        try:
            goal_handle.abort()
        except Exception:
            if not stopping:
                raise
        return result
