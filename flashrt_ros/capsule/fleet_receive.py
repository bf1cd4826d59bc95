"""Pipelined GETs whose values are read off the socket straight into their places.

redis-py's parsers copy a value through their buffer into a bytes object, which a pull would
then copy again into the capsule's memory. A pull knows every value's length and place before
it asks (the manifest's cut), so it reads the replies itself, off the socket of one of the
client's pooled connections (connected, authenticated and wrapped in TLS as the pool is
configured): each reply's header through a small buffer, and a value's bytes with
``recv_into`` into their place, through the buffer only for what arrived with a header.

A connection goes back to the pool only once every reply was read whole, each matched its
place and nothing followed the last; at any other end it is closed, so no pooled connection is
left with replies in flight. The socket's timeout is the pool's ``socket_timeout``: every read
is bounded by it.
"""
from __future__ import annotations

import socket
import time
from typing import NamedTuple, Sequence

import redis

_BUFFER = 64 << 10       # the read buffer: headers, and values or their parts that came with them
_DIRECT = 16 << 10       # a value's remainder at least this long is read into its place directly
_LONGEST_LINE = 4 << 10  # a header longer than this is not a reply this reader asks for


class Unfit(NamedTuple):
    """The reply to key ``index`` does not fit its place: no value (``length`` None: the key is
    gone), or a value of ``length`` bytes, not the place's."""

    index: int
    length: int | None


def get_into(client: redis.Redis, keys: Sequence[str], places: Sequence[memoryview]) -> Unfit | None:
    """GET every key in one pipeline, the value of ``keys[i]`` written into ``places[i]``
    (writable, as long as the value must be). None when every value fit; else the first reply
    that did not (the places from there on hold anything). Server errors and lost or slow
    connections raise redis-py's exceptions, as its own calls do. A connection lost is tried
    once more on a fresh one, as the pool's own retry does: GETs change nothing, and every
    place is written again whole."""
    if len(keys) != len(places):
        raise ValueError(f"{len(keys)} keys for {len(places)} places")
    try:
        return _get_into(client.connection_pool, keys, places)
    except redis.exceptions.TimeoutError:
        raise
    except redis.exceptions.ConnectionError:
        return _get_into(client.connection_pool, keys, places)


def _get_into(pool: redis.ConnectionPool, keys: Sequence[str], places: Sequence[memoryview]) -> Unfit | None:
    connection = pool.get_connection()
    whole = False
    try:
        connection.send_packed_command(connection.pack_commands([("GET", key) for key in keys]))
        sock = connection._sock   # the pool's own socket: redis-py has no public handle on it
        if sock is None:   # closed meanwhile (the tier closed by another thread)
            raise redis.exceptions.ConnectionError("the connection was closed while its replies were awaited")
        reader = _Reader(sock)
        for index, place in enumerate(places):
            size = reader.header()
            if size != len(place):
                return Unfit(index, size)
            reader.into(place)
            reader.end_of_value()
        # Anything past the last reply is no answer of ours (a RESP3 push): the connection is
        # not handed on with it.
        whole = reader.start == reader.end
        if whole and connection.health_check_interval:   # as redis-py does after a reply read
            connection.next_health_check = time.monotonic() + connection.health_check_interval
        return None
    except socket.timeout:
        raise redis.exceptions.TimeoutError("Timeout reading from socket") from None
    except OSError as exc:
        raise redis.exceptions.ConnectionError(f"Error while reading from socket: {exc}") from None
    finally:
        if not whole:
            connection.disconnect()
        pool.release(connection)


class _Reader:
    """RESP replies to GET off one socket: bulk strings, nil (RESP2 and 3) and errors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray(_BUFFER)
        self.view = memoryview(self.buffer)
        self.start = self.end = 0   # the unread bytes are buffer[start:end]

    def header(self) -> int | None:
        """The next reply's value length, or None for no value; a server error raises."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"$" and rest == b"-1":
            return None
        if kind == b"$" and rest.isdigit():
            return int(rest)
        if kind == b"_":
            return None
        if kind == b"-":
            raise redis.exceptions.ResponseError(rest.decode("utf-8", "replace"))
        raise redis.exceptions.InvalidResponse(f"a GET answered {line[:40]!r}")

    def into(self, place: memoryview) -> None:
        """The value's bytes into ``place``: what is buffered, then the rest."""
        done = self._take(place)
        while done < len(place):
            if len(place) - done >= _DIRECT:
                got = self.sock.recv_into(place[done:])
                if not got:
                    raise ConnectionError("the server closed the connection")
                done += got
            else:
                self._fill()
                done += self._take(place[done:])

    def end_of_value(self) -> None:
        if self._line():
            raise redis.exceptions.InvalidResponse("a value ran past its length")

    def _take(self, place: memoryview) -> int:
        n = min(len(place), self.end - self.start)
        place[:n] = self.view[self.start:self.start + n]
        self.start += n
        return n

    def _line(self) -> bytes:
        while True:
            stop = self.buffer.find(b"\r\n", self.start, self.end)
            if stop >= 0:
                line = bytes(self.view[self.start:stop])
                self.start = stop + 2
                return line
            if self.end - self.start > _LONGEST_LINE:
                raise redis.exceptions.InvalidResponse("a reply's header has no end")
            self._fill()

    def _fill(self) -> None:
        """More bytes from the socket after the unread ones (moved to the front first)."""
        unread = self.end - self.start
        if self.start:
            self.view[:unread] = self.view[self.start:self.end]
            self.start, self.end = 0, unread
        got = self.sock.recv_into(self.view[self.end:])
        if not got:
            raise ConnectionError("the server closed the connection")
        self.end += got
