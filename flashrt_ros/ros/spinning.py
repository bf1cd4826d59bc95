"""Spinning an executor through the failures of single callbacks, until shutdown."""
from __future__ import annotations

import time
import traceback
from typing import Callable

from rclpy.context import Context
from rclpy.executors import Executor, ExternalShutdownException

from .rclpy_compat import RCLError


def spin_until_shutdown(executor: Executor, context: Context, failed: Callable[[str], None]) -> None:
    """Spin until the context shuts down. An exception a callback lets out, which would end
    ``spin``, is passed to ``failed`` as its traceback, and spinning goes on: that request
    is lost, the node must not be. A KeyboardInterrupt still ends it."""
    while True:
        try:
            executor.spin()
            return
        except ExternalShutdownException:
            return
        except RCLError:
            # A shutdown that lands between two waits shows up as an invalid context.
            if not context.ok():
                return
            failed(traceback.format_exc())
        except Exception:
            failed(traceback.format_exc())
        time.sleep(0.01)   # never a hot loop, whatever keeps failing
