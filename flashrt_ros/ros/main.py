"""Entry point of the ``flashrt_node`` executable."""
from __future__ import annotations

import os
import sys

import rclpy
from rclpy.executors import ExternalShutdownException, MultiThreadedExecutor

from .node import FlashRTNode
from .rclpy_compat import RCLError
from .spinning import spin_until_shutdown


def main(args: list[str] | None = None) -> int:
    rclpy.init(args=args)
    node = None
    try:
        try:
            node = FlashRTNode()
        except Exception as exc:  # bad parameters are refused at declaration, with rclpy's reason
            print(f"flashrt_node: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
        if node.get_parameter("autostart").value:
            node.trigger_configure()
            if node.engine is not None:  # configure succeeded
                node.trigger_activate()
        # Threads: generation, policy steps, timers and a few concurrent services.
        executor = MultiThreadedExecutor(num_threads=max(4, os.cpu_count() or 1))
        executor.add_node(node)
        spin_until_shutdown(executor, node.context,
                            lambda trace: node.get_logger().error(f"a callback failed; serving on:\n{trace}"))
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


if __name__ == "__main__":
    sys.exit(main())
