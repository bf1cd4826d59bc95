"""Entry point of the ``flashrt_node`` executable."""
from __future__ import annotations

import os
import sys

from rclpy.executors import MultiThreadedExecutor

from .node import FlashRTNode
from .spinning import run_node


def _autostart(node: FlashRTNode) -> None:
    if node.get_parameter("autostart").value:
        node.trigger_configure()
        if node.engine is not None:  # configure succeeded
            node.trigger_activate()


def main(args: list[str] | None = None) -> int:
    # Threads: generation, policy steps, timers and a few concurrent services.
    return run_node("flashrt_node", FlashRTNode, lambda: MultiThreadedExecutor(num_threads=max(4, os.cpu_count() or 1)),
                    start=_autostart, args=args)


if __name__ == "__main__":
    sys.exit(main())
