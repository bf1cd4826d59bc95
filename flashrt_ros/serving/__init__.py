"""The session layer, between the engine and ROS (no ROS imports): what a served engine adds to
the engine's own calls. Request ids that name one snapshot, leases on capsules a client made,
the journal of committed operations, and generation that stops when the state it extends is
replaced. The node only converts messages and calls it."""
from .journal import Entry, Journal
from .session import Session

__all__ = ["Entry", "Journal", "Session"]
