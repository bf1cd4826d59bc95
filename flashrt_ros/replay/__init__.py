"""Record a session's committed operations and replay them deterministically (no ROS imports).

``journal``: the entries and their replay on an engine; ``bag``: MCAP bags of
them (rosbags); ``cli``: the ``flashrt-replay`` command.
"""
from ..serving.journal import Entry, Journal
from .journal import ReplayMismatch, ReplayReport, replay

__all__ = ["Entry", "Journal", "ReplayMismatch", "ReplayReport", "replay"]
