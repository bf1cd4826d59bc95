"""Capsules: the whole execution state as immutable, verifiable snapshots. No ROS imports.

This layer sees the arena only as a region table and a byte buffer; the
engine (``flashrt_ros.runtime.engine``) drives it at committed boundaries.
"""
from .errors import (BudgetExceeded, CapsuleError, CapsuleIOError, CorruptCapsule, FingerprintMismatch,
                     FleetUnavailable, IncompleteCapsule, InvalidCapsuleRequest, UnknownCapsule)
from .info import TIERS, CapsuleInfo
from .layout import Layout
from .store import CapsuleStore

# The fleet tier (``capsule.fleet``) is imported where it is used: it brings in the redis client.
__all__ = ["BudgetExceeded", "CapsuleError", "CapsuleIOError", "CapsuleInfo", "CapsuleStore", "CorruptCapsule",
           "FingerprintMismatch", "FleetUnavailable", "IncompleteCapsule", "InvalidCapsuleRequest", "Layout", "TIERS",
           "UnknownCapsule"]
