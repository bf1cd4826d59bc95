"""The node's journal bag: the journal (replay's input) and every message the node served, each
on its own topic with its real ROS type, stamped by the node's clock (sim time under use_sim_time).

Topics besides the journal's two:
  the observation topics   sensor_msgs/JointState and geometry_msgs/PoseStamped, and ~/goal
                           (PoseStamped) and ~/route (PoseArray), as received
  the action topic         trajectory_msgs/JointTrajectoryPoint, as published
  ~/events                 flashrt_ros/CapsuleEvent, as published
  <service>/_service_event flashrt_ros/srv/<Srv>_Event: a REQUEST_RECEIVED event with the request and
                           a RESPONSE_SENT event with the response, as Jazzy's service introspection
                           publishes them at its "contents" level
  ~/generate/goal          flashrt_ros/action/Generate_Goal, each goal executed, and
  ~/generate/result        flashrt_ros/action/Generate_Result, its result (Jazzy introspects no actions)
A message that cannot be written is logged and the node goes on serving; the journal stops on
its own failures (see serving.session), since a journal with a gap would not replay.
"""
from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

from rclpy.node import Node
from rclpy.serialization import serialize_message
from service_msgs.msg import ServiceEventInfo

from ..replay.bag import BagWriter
from ..replay.types import canonical
from ..serving.journal import Entry
from ..serving.record import SessionRecord


def type_name(msg: Any) -> str:
    """``pkg/msg/Name`` (or ``srv``, ``action``) of a generated ROS message instance."""
    package, kind = type(msg).__module__.split(".")[:2]
    return f"{package}/{kind}/{type(msg).__name__}"


class Recorder:
    """A Journal listener that also writes what the node served (see the module docstring)."""

    def __init__(self, path: Path, session: SessionRecord, node: Node) -> None:
        self._node = node
        self.bag = BagWriter(path, session, clock=lambda: node.get_clock().now().nanoseconds,
                             flush_each=True)
        self._sequence = itertools.count(1)
        self._warned = threading.Event()

    def __call__(self, entry: Entry) -> None:
        self.bag(entry)

    def message(self, topic: str, msg: Any) -> None:
        try:
            name = type_name(msg)
            self.bag.write_message(topic, name, canonical(serialize_message(msg), name))
        except Exception as exc:   # a recording must never cost an answer or a step
            if not self._warned.is_set():
                self._warned.set()
                self._node.get_logger().error(f"journal bag: {topic} not recorded ({exc}); later failures unlogged")

    def service_event(self, srv: Any, service: str, request: Any, response: Any) -> None:
        sequence = next(self._sequence)
        for event_type, part in ((ServiceEventInfo.REQUEST_RECEIVED, "request"),
                                 (ServiceEventInfo.RESPONSE_SENT, "response")):
            event = srv.Event(info=ServiceEventInfo(event_type=event_type, sequence_number=sequence,
                                                    stamp=self._node.get_clock().now().to_msg()))
            setattr(event, part, [request if part == "request" else response])
            self.message(f"{service}/_service_event", event)

    def close(self) -> None:
        self.bag.close()
