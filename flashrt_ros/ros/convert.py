"""Between engine values and ROS messages: capsule metadata, errors, stamps."""
from __future__ import annotations

from builtin_interfaces.msg import Time
from rclpy.serialization import deserialize_message

from ..capsule import CapsuleInfo
from ..errors import ErrorCode, FlashRTError
from ..msg import CapsuleInfo as CapsuleInfoMsg
from ..msg import JournalSession
from ..replay.bag import SESSION_TYPE, session_message
from ..replay.types import typestore
from ..serving.record import SessionRecord


def stamp(seconds: float) -> Time:
    """A ROS Time for seconds since the epoch; zero for what it cannot hold (a message that
    fails to serialise would fail the whole answer, not just its stamp)."""
    if not 0 <= seconds < 2 ** 31:   # False for NaN too
        return Time()
    whole = int(seconds)
    return Time(sec=whole, nanosec=min(int((seconds - whole) * 1e9), 999_999_999))


def info_msg(info: CapsuleInfo | None) -> CapsuleInfoMsg:
    if info is None:
        return CapsuleInfoMsg()
    return CapsuleInfoMsg(
        id=info.id, name=info.name, parent=info.parent, position=info.position, nbytes=info.nbytes,
        tier=info.tier, digest=info.digest, pinned=info.pinned, created=stamp(info.created),
        model_fingerprint=info.model_fingerprint, layout_fingerprint=info.layout_fingerprint)


def outcome(exc: BaseException) -> tuple[int, str]:
    """(error_code, message) for an exception raised while serving a request."""
    if isinstance(exc, FlashRTError):
        return int(exc.code), str(exc) or type(exc).__name__
    return int(ErrorCode.INTERNAL), f"internal error: {type(exc).__name__}: {exc}"


def session_msg(session: SessionRecord, stamp_ns: int = 0) -> JournalSession:
    """The JournalSession of a session record, built once (``replay.bag``) for bags and topics alike."""
    return deserialize_message(bytes(typestore().serialize_cdr(session_message(session, stamp_ns), SESSION_TYPE)),
                               JournalSession)
