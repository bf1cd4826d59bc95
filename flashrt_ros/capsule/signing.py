"""Optional authenticity for capsule files: an HMAC-SHA256 over the header, with a shared key.

Without a key, a capsule file's digests catch accidents (a flipped bit, a torn write), not a
deliberate edit: anyone can recompute them. With a key, every file this engine writes carries
a ``signature`` over its header, which names the data's digest, so no byte of the file can be
changed without the key; a file without a valid signature is refused.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

from .errors import InvalidCapsuleRequest, UntrustedCapsule

FIELD = "signature"
# A key shorter than the hash is weaker than the hash; one longer is hashed down by HMAC.
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096


def canonical(header: dict, without: tuple[str, ...]) -> bytes:
    """The header as the bytes its digests and its signature cover: sorted keys, no spaces."""
    return json.dumps({k: v for k, v in header.items() if k not in without}, sort_keys=True,
                      separators=(",", ":")).encode()


def sign(key: bytes, header: dict) -> str:
    """The signature of ``header`` (every field but the header digest and the signature)."""
    return hmac.new(key, canonical(header, ("header_digest", FIELD)), hashlib.sha256).hexdigest()


def check(key: bytes | None, header: dict, name: str) -> None:
    """UntrustedCapsule unless ``header`` carries a valid signature under ``key`` (None: no check)."""
    if key is None:
        return
    signature = header.get(FIELD)
    if not isinstance(signature, str):
        raise UntrustedCapsule(f"{name}: the capsule is not signed, and this engine has a capsule key")
    if not hmac.compare_digest(signature, sign(key, header)):
        raise UntrustedCapsule(f"{name}: the capsule's signature does not match this engine's capsule key")


def load_key(path: str | os.PathLike) -> bytes:
    """The key in the file at ``path`` (its bytes as they are, one trailing newline dropped).
    InvalidCapsuleRequest if it is not a regular file, cannot be read, or is shorter than
    MIN_KEY_BYTES.

    Opened without blocking and checked with ``fstat`` before a byte is read: a FIFO or a
    device would otherwise hold the caller (a node's configure) until a writer comes. A link is
    followed, since mounted secrets are commonly links to the file that holds the key."""
    name = os.fspath(path)
    try:
        fd = os.open(Path(path), os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidCapsuleRequest(f"capsule key file {name!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidCapsuleRequest(f"capsule key file {name!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            key = f.read(MAX_KEY_BYTES + 2)   # the longest key, its newline, and a byte that refuses it
        except OSError as exc:
            raise InvalidCapsuleRequest(f"capsule key file {name!r}: {exc.strerror or exc}") from None
    key = key[:-1] if key.endswith(b"\n") else key
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidCapsuleRequest(f"capsule key file {name!r} holds {len(key)} bytes; a key is "
                                    f"{MIN_KEY_BYTES} to {MAX_KEY_BYTES} bytes (e.g. head -c 32 /dev/urandom)")
    return key
