"""Error codes shared by every layer, mirrored one to one by ``msg/ErrorCode.msg``.

Kept ROS-free so that ``runtime`` and ``capsule`` can raise errors that the ROS
adapter turns into ``error_code`` fields without a lookup table of its own.
"""
from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    OK = 0
    UNKNOWN_CAPSULE = 1
    INVALID_ARGUMENT = 2
    FINGERPRINT_MISMATCH = 3
    CORRUPT_CAPSULE = 4
    BUDGET_EXCEEDED = 5
    BUSY = 6
    NOT_ACTIVE = 7
    IO_ERROR = 8
    INTERNAL = 9
    PREEMPTED = 10
    UNTRUSTED_CAPSULE = 11
    CONTEXT_FULL = 12
    FLEET_UNAVAILABLE = 13
    INCOMPLETE_CAPSULE = 14


def shown(value: object, limit: int = 80) -> str:
    """``repr`` of a caller's value for an error message, cut to about ``limit`` characters:
    a request field can be megabytes, and messages go to logs, topics and journals."""
    text = value if isinstance(value, str) else str(value)
    return repr(text if len(text) <= limit else f"{text[:limit - 3]}...")


class FlashRTError(Exception):
    """Base of every error this package raises on purpose; ``code`` says which kind."""

    code: ErrorCode = ErrorCode.INTERNAL


class InvalidArgument(FlashRTError, ValueError):
    """The caller asked for something the engine cannot do; nothing was changed."""

    code = ErrorCode.INVALID_ARGUMENT


class ContextFull(InvalidArgument):
    """The state holds max_seq_len positions already: nothing more can be committed until a
    restore, rollback or reset frees some (a request that is merely too long for the room
    left is an InvalidArgument)."""

    code = ErrorCode.CONTEXT_FULL


class CheckpointError(FlashRTError):
    """A checkpoint could not be read, or does not match its config."""

    code = ErrorCode.IO_ERROR


class NotActive(FlashRTError):
    """The serving side is not in the active lifecycle state (or has no engine)."""

    code = ErrorCode.NOT_ACTIVE


class Busy(FlashRTError):
    """Another operation that cannot run alongside this one is in progress."""

    code = ErrorCode.BUSY


class Preempted(FlashRTError):
    """A restore, rollback or reset replaced the state that a running generation was extending."""

    code = ErrorCode.PREEMPTED
