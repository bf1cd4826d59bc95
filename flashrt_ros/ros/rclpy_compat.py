"""The one place this package reaches into rclpy's private API, and why.

``RCLError``: the error rcl calls raise (a transition refused, a context shut down under a
call), which rclpy defines only in its compiled module and exports nowhere public.

rclpy's lifecycle node answers ``~/change_state`` through ``LifecycleNode._service_change_state``,
whose callback raises RCLError for a transition the current state does not have (a second
configure from a lifecycle manager that retries, say): the exception leaves the callback, no
answer is sent, and the caller waits out its timeout. No public hook exists to answer instead.
Checked on rclpy 7.1.6 (Jazzy) and 9.1.2 (Kilted); where the attribute is gone, nothing is
changed and rclpy's own behaviour stands.

``executor_shut_down``: whether an executor's own shutdown was called. ``Executor.spin`` asks
this (``_is_shutdown``) and no public method does; a loop of ``spin_once`` that does not
ask it would spin hot once the executor is shut down (``spinning.spin_until_shutdown``).
Where the attribute is gone it answers False, and the loop ends by its other conditions.
"""
from __future__ import annotations

from typing import Any

from rclpy._rclpy_pybind11 import RCLError


def executor_shut_down(executor: Any) -> bool:
    """Whether ``executor.shutdown()`` was called."""
    return bool(getattr(executor, "_is_shutdown", False))


def answer_invalid_transitions(node: Any) -> None:
    """Make ``node``'s change_state service answer success=false for an impossible transition."""
    service = getattr(node, "_service_change_state", None)
    if service is None:
        return
    change = service.callback

    def answered(request: Any, response: Any) -> Any:
        try:
            return change(request, response)
        except RCLError as exc:
            node.get_logger().warning(f"change_state refused: transition {request.transition.id} "
                                      f"{request.transition.label!r}: {str(exc).splitlines()[0][:200]}")
            response.success = False
            return response

    service.callback = answered
