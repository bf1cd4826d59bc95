"""Record a session's committed operations and replay them (no ROS imports).

``journal``: the entries and their replay on an engine; ``verdicts``: exact and portable,
judged per message; ``session``: the engine and platform a session ran on; ``bag``: MCAP
bags of them (rosbags); ``cli``: the ``flashrt-replay`` command.
"""
from ..serving.journal import Entry, Journal
from .journal import ReplayMismatch, judge, replay
from .verdicts import Tolerance, Verdicts

__all__ = ["Entry", "Journal", "ReplayMismatch", "Tolerance", "Verdicts", "judge", "replay"]
