"""Entry point of the ``flashrt_node`` executable."""
from __future__ import annotations

import sys

from rclpy.executors import SingleThreadedExecutor

from .node import FlashRTNode
from .spinning import run_node


def _autostart(node: FlashRTNode) -> None:
    if node.get_parameter("autostart").value:
        node.trigger_configure()
        if node.engine is not None:  # configure succeeded
            node.trigger_activate()


def main(args: list[str] | None = None) -> int:
    # One thread for the lifecycle node's timers and services: generation, policy steps and the
    # capsule services run on side nodes of their own (see ``side_node`` for why).
    return run_node("flashrt_node", FlashRTNode, SingleThreadedExecutor, start=_autostart, args=args)


if __name__ == "__main__":
    sys.exit(main())
