"""Spinning an executor through the failures of single callbacks, until shutdown; a node spun
on a thread for the length of a block; and a node's program around it."""
from __future__ import annotations

import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import rclpy
from rclpy.context import Context
from rclpy.executors import Executor, ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node

from .rclpy_compat import RCLError, executor_shut_down


def spin_until_shutdown(executor: Executor, context: Context, failed: Callable[[str], None],
                        stopped: threading.Event | None = None) -> None:
    """Spin until the context or the executor shuts down, or ``stopped`` is set (the caller
    sets it, then shuts the executor down, which wakes this loop). An exception a callback lets out, which would end ``spin``, is passed to
    ``failed`` as its traceback, and spinning goes on: that request is lost, the node must not
    be. A KeyboardInterrupt still ends it.

    With ``stopped``, ``stopped`` is asked before the context: Kilted's Context.shutdown holds
    the context's lock while it destroys the nodes it tracks, and a node that stops this thread
    from its destroy_node would otherwise find it waiting on that lock (``executor.spin`` asks
    ``context.ok()`` first) until the shutdown is over."""
    def spin() -> None:
        if stopped is None:
            executor.spin()
            return
        # As Executor.spin, the executor's own shutdown ends it too: spin_once returns at once
        # from a shut-down executor, and the loop would never wait again.
        while not stopped.is_set() and context.ok() and not executor_shut_down(executor):
            executor.spin_once()

    while True:
        try:
            spin()
            return
        except ExternalShutdownException:
            return
        except RCLError:
            # A shutdown that lands between two waits shows up as an invalid context.
            if (stopped is not None and stopped.is_set()) or not context.ok():
                return
            failed(traceback.format_exc())
        except Exception:
            if stopped is not None and stopped.is_set():
                return   # the node went while this thread was waking: no callback's fault
            failed(traceback.format_exc())
        time.sleep(0.01)   # never a hot loop, whatever keeps failing


@contextmanager
def spun(node: Node, join_s: float = 5.0) -> Iterator[Executor]:
    """``node`` spun by a single-threaded executor on a thread of its own for the length of the
    block; after it, the executor is shut down, the thread joined (out of rclpy's wait), and
    only then the node destroyed, here. A node destroyed while that thread still waits on it is
    torn down wherever its last use ends, and with the context's last node goes its DDS
    participant: torn down on the spinning thread while the caller stops the processes it
    talked to, Fast DDS can deadlock there (the participant waits for a discovery callback of a
    leaving peer, which waits for it) with the GIL held, and every thread of the process stops."""
    executor = SingleThreadedExecutor(context=node.context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, name=f"spin-{node.get_name()}", daemon=True)
    spinner.start()
    try:
        yield executor
    finally:
        executor.shutdown(timeout_sec=join_s)
        spinner.join(join_s)
        node.destroy_node()


def run_node(program: str, make: Callable[[], Any], make_executor: Callable[[], Executor],
             start: Callable[[Any], None] | None = None, args: list[str] | None = None) -> int:
    """A node's program: ``make`` the node (exit 2 with rclpy's reason when its parameters are
    refused), ``start`` it, spin until shutdown (SIGINT, SIGTERM), clean up; exit 0."""
    rclpy.init(args=args)
    node = None
    try:
        try:
            node = make()
        except Exception as exc:  # bad parameters are refused at declaration, with rclpy's reason
            print(f"{program}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        if start is not None:
            start(node)
        executor = make_executor()
        executor.add_node(node)
        spin_until_shutdown(executor, node.context,
                            lambda trace: node.get_logger().error(f"a callback failed; going on:\n{trace}"))
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except RCLError:
        # SIGTERM shuts the context down; a call that starts just after (a configure at start,
        # say) sees an invalid context instead of ExternalShutdownException. Only that is benign.
        if rclpy.ok():
            raise
    finally:
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
    return 0
