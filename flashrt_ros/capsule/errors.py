"""Capsule errors: each carries the ``ErrorCode`` the ROS layer answers with."""
from __future__ import annotations

from ..errors import ErrorCode, FlashRTError, InvalidArgument


class CapsuleError(FlashRTError):
    """Base of every capsule refusal. The live state is untouched when one is raised."""

    code = ErrorCode.INTERNAL


class UnknownCapsule(CapsuleError):
    code = ErrorCode.UNKNOWN_CAPSULE


class InvalidCapsuleRequest(CapsuleError, InvalidArgument):
    """A bad capsule request (name, tier, steps, position): both a CapsuleError and an InvalidArgument."""

    code = ErrorCode.INVALID_ARGUMENT


class FingerprintMismatch(CapsuleError):
    code = ErrorCode.FINGERPRINT_MISMATCH


class CorruptCapsule(CapsuleError):
    code = ErrorCode.CORRUPT_CAPSULE


class UntrustedCapsule(CorruptCapsule):
    """A capsule file without a valid signature, read by an engine that has a capsule key."""

    code = ErrorCode.UNTRUSTED_CAPSULE


class BudgetExceeded(CapsuleError):
    code = ErrorCode.BUDGET_EXCEEDED


class CapsuleIOError(CapsuleError):
    code = ErrorCode.IO_ERROR


class FleetUnavailable(CapsuleIOError):
    """The fleet tier's server cannot be reached, refused this client (authentication, ACL),
    or did not answer within the timeout. Nothing local changed."""

    code = ErrorCode.FLEET_UNAVAILABLE


class IncompleteCapsule(CorruptCapsule):
    """A fleet capsule's manifest names a chunk the server no longer holds (evicted, collected):
    refused whole, never restored in part."""

    code = ErrorCode.INCOMPLETE_CAPSULE
