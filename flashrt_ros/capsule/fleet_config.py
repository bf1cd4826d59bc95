"""Where the fleet tier's server is and how to talk to it: the URL, the credentials, the
timeouts, the key prefix, and the names of the keys under it.

One client library (redis-py) for Valkey and Redis alike. The URL names the server
(``redis://host:6379/0``, ``rediss://`` for TLS, ``unix:///path``) and an ACL user
(``redis://robot7@host:6379/0``); the password comes from a file, never from the URL: a URL
is a node parameter, and parameters can be read by anyone on the ROS graph.
"""
from __future__ import annotations

import os
import re
import socket
import stat
from dataclasses import dataclass, field
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from ..errors import shown
from .errors import InvalidCapsuleRequest

_PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")    # no ':' (the separator) and no glob characters (SCAN MATCH)
_NODE = re.compile(r"[A-Za-z0-9_.:@/-]{1,128}")
# URL options that would unbind the timeouts this module sets, or leak a secret into a parameter.
_REFUSED_OPTIONS = ("socket_timeout", "socket_connect_timeout", "timeout", "retry_on_timeout", "retry_on_error")
MIN_CHUNK_BYTES = 4096
# Far under the server's value limit (proto-max-bulk-len, 512 MiB by default), and small enough
# that one value is one short transfer, each bounded by the socket timeout.
MAX_CHUNK_BYTES = 64 << 20
MAX_CHUNK_ROWS = 1 << 20
MAX_SECRET_BYTES = 4096


def node_id(within: str = "") -> str:
    """This machine's name and ``within`` (a process's own name on it, such as a ROS node's),
    cut to a node id's form: the holder of the references a client makes."""
    name = re.sub(r"[^A-Za-z0-9_.:@/-]", "-", socket.gethostname() + within)[:128]
    return name or "node"


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """Validated on construction; ``InvalidCapsuleRequest`` names the field and its limit.

    ``timeout_s`` bounds each exchange with the server (a reply, or one value sent or received)
    and ``connect_timeout_s`` each connection attempt; a call that finds its connection lost
    retries once on a fresh one (a timeout is not retried). ``chunk_bytes`` and ``chunk_rows`` shape the chunks
    (``fleet_chunks``): keep them equal across a fleet, or its capsules share no chunks.
    ``grace_s``: how long a chunk written by a publish in progress is safe from ``collect``;
    it must exceed the longest publish. ``node``: who holds the references this client makes.
    ``batch_bytes``: the bytes of one pipelined batch (between two batches a publish or a pull
    checks its deadline)."""

    url: str
    prefix: str = "flashrt"
    password_file: str = ""
    username: str = ""
    timeout_s: float = 2.0
    connect_timeout_s: float = 2.0
    chunk_bytes: int = 4 << 20
    chunk_rows: int = 256
    grace_s: float = 600.0
    node: str = field(default_factory=node_id)
    batch_bytes: int = 16 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise InvalidCapsuleRequest(f"fleet url {shown(self.url)}: use redis://host:port/db, rediss:// "
                                        "(TLS) or unix:///path")
        if not isinstance(self.prefix, str) or not _PREFIX.fullmatch(self.prefix):
            raise InvalidCapsuleRequest(f"fleet prefix {shown(self.prefix)}: use 1-64 of [A-Za-z0-9_.-]")
        if not isinstance(self.node, str) or not _NODE.fullmatch(self.node):
            raise InvalidCapsuleRequest(f"fleet node id {shown(self.node)}: use 1-128 of [A-Za-z0-9_.:@/-]")
        for name in ("timeout_s", "connect_timeout_s", "grace_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
                raise InvalidCapsuleRequest(f"fleet {name} must be a number of seconds in (0, 1e6), got {value!r}")
        _check_int("chunk_bytes", self.chunk_bytes, MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
        _check_int("chunk_rows", self.chunk_rows, 1, MAX_CHUNK_ROWS)
        _check_int("batch_bytes", self.batch_bytes, MIN_CHUNK_BYTES, 1 << 30)
        if not isinstance(self.username, str) or not isinstance(self.password_file, str):
            raise InvalidCapsuleRequest("fleet username and password_file are strings")
        self.connection_options()   # a bad URL is refused here, not at the first call

    def connection_options(self) -> dict[str, Any]:
        """The URL's own options, checked: no password in it, no timeouts of its own."""
        try:
            options = parse_url(self.url)
        except ValueError as exc:
            raise InvalidCapsuleRequest(f"fleet url {shown(self.url)}: {exc}") from None
        if "password" in options:
            raise InvalidCapsuleRequest("fleet url carries a password: put it in password_file (the url is a "
                                        "parameter anyone on the ROS graph can read)")
        set_in_url = sorted(set(options) & set(_REFUSED_OPTIONS))
        if set_in_url:
            raise InvalidCapsuleRequest(f"fleet url sets {', '.join(set_in_url)}: the fleet tier's timeout_s and "
                                        "connect_timeout_s bound every call")
        if options.get("protocol", 2) != 2:
            raise InvalidCapsuleRequest(f"fleet url sets protocol={options['protocol']}: the fleet tier speaks RESP2 "
                                        "(a pull reads its replies itself; fleet_receive)")
        if self.username and "username" in options:
            raise InvalidCapsuleRequest("fleet username is given twice (in the url and as username)")
        return options

    def connect(self) -> redis.Redis:
        """A client on a connection pool (thread-safe); it connects at its first call."""
        options: dict[str, Any] = {}
        if self.username:
            options["username"] = self.username
        if self.password_file:
            options["password"] = read_secret(self.password_file)
        pool = redis.ConnectionPool.from_url(
            self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.connect_timeout_s,
            # One retry, on a lost connection only (a pooled one the server closed meanwhile): a
            # timeout is not retried, so a slow server costs one timeout, not several.
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            # RESP2: no server push can come between a pull's replies, which it reads itself
            # (fleet_receive); redis-py would speak RESP3 otherwise.
            health_check_interval=30, protocol=2, **options)
        return redis.Redis(connection_pool=pool)


def _check_int(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidCapsuleRequest(f"fleet {name} must be an int in [{low}, {high}], got {value!r}")


def read_secret(path: str) -> str:
    """The password in the file at ``path`` (UTF-8, one trailing newline dropped).
    Opened without blocking and checked to be a regular file before a byte is read, as
    ``signing.load_key`` does: a FIFO would hold the caller until a writer comes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise InvalidCapsuleRequest(f"fleet password file {path!r}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidCapsuleRequest(f"fleet password file {path!r} is not a regular file")
    with os.fdopen(fd, "rb") as f:
        try:
            raw = f.read(MAX_SECRET_BYTES + 2)
        except OSError as exc:
            raise InvalidCapsuleRequest(f"fleet password file {path!r}: {exc.strerror or exc}") from None
    raw = raw[:-1] if raw.endswith(b"\n") else raw
    if not 0 < len(raw) <= MAX_SECRET_BYTES:
        raise InvalidCapsuleRequest(f"fleet password file {path!r} holds {len(raw)} bytes; a password is "
                                    f"1 to {MAX_SECRET_BYTES} bytes")
    try:
        return raw.decode()
    except UnicodeDecodeError:
        raise InvalidCapsuleRequest(f"fleet password file {path!r} is not UTF-8 text") from None


class FleetKeys:
    """The server's keys under one prefix. Chunks are named by the BLAKE3 digest of their
    bytes alone, so any capsule of any model under the prefix reuses a chunk it holds."""

    __slots__ = ("prefix", "touched")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        # Sorted set: chunk digest -> the last time (server ms) a publisher touched it.
        self.touched = f"{prefix}:touched"

    def chunk(self, digest: str) -> str:
        return f"{self.prefix}:chunk:{digest}"

    def manifest(self, capsule_id: str) -> str:
        return f"{self.prefix}:manifest:{capsule_id}"

    def holders(self, capsule_id: str) -> str:
        """Sorted set: node id -> the end of its lease on the capsule (server ms; inf: until dropped)."""
        return f"{self.prefix}:holders:{capsule_id}"

    def names_of(self, capsule_id: str) -> str:
        """Set: the names that were pointed at the capsule (each checked before it is used)."""
        return f"{self.prefix}:names:{capsule_id}"

    def name(self, name: str) -> str:
        return f"{self.prefix}:name:{name}"

    @property
    def name_prefix(self) -> str:
        return f"{self.prefix}:name:"

    def pattern(self, kind: str) -> str:
        """The SCAN pattern of one kind of key (prefixes hold no glob characters)."""
        return f"{self.prefix}:{kind}:*"
