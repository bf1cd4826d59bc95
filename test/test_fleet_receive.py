"""Pipelined GETs read straight into their places (``fleet_receive``), against a real server:
values of every size around the reader's buffer land whole; a missing key, a value of
another length, a server error and a silent server each end the call clearly, and none
leaves a reply in flight on a connection the client uses next."""
import os
import socket
import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fleet_harness import TlsFront
from flashrt_ros.capsule.fleet_receive import _BUFFER, _DIRECT, Unfit, get_into


def _client(server, timeout: float = 10) -> redis.Redis:
    """A client as the fleet tier's (RESP2, no retry of its own: fleet_config)."""
    options = {"socket_timeout": timeout, "socket_connect_timeout": 10, "protocol": 2, "retry": Retry(NoBackoff(), 0)}
    if isinstance(server, TlsFront):
        return redis.Redis.from_url(server.url, **options)
    return redis.Redis(host="127.0.0.1", port=server.port, **options)


def _places(sizes):
    buffers = [bytearray(b"\xee" * n) for n in sizes]
    return buffers, [memoryview(b) for b in buffers]


def _still_in_step(client: redis.Redis, server, connection_before: int, reused: bool) -> None:
    """Checked before the client's next command: the connection the server knew as
    ``connection_before`` is open still (``reused``: it went back to the pool) or was closed
    (so no reply was left in flight on a pooled connection). Then the client's next commands
    get their own replies."""
    watcher = server.client()
    deadline = time.monotonic() + 10   # a close reaches the server's list soon after; a bound, not a speed
    while (str(connection_before) in {c["id"] for c in watcher.client_list()}) != reused:
        assert not reused and time.monotonic() < deadline, \
            f"connection {connection_before} {'closed' if reused else 'still open'}"
        time.sleep(0.02)
    assert (client.client_id() == connection_before) == reused
    client.set("probe", b"p" * 5)
    for _ in range(3):
        assert client.get("probe") == b"p" * 5
        assert client.incr("counter") > 0


SIZES = [0, 1, 7, _DIRECT - 1, _DIRECT, _DIRECT + 1, _BUFFER - 5, _BUFFER, _BUFFER + 1, 3 * _BUFFER + 17,
         (2 << 20) + 3, 12, 5]


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_values_of_every_size_around_the_buffer_land_whole_in_their_places(kv_server, tmp_path, tls):
    front = TlsFront(kv_server, tmp_path) if tls else None
    try:
        client = _client(front or kv_server)
        values = [os.urandom(n) for n in SIZES]
        for i, v in enumerate(values):
            client.set(f"k{i}", v)
        before = client.client_id()
        for _ in range(2):   # the second call takes the connection the first gave back
            buffers, places = _places(SIZES)
            assert get_into(client, [f"k{i}" for i in range(len(SIZES))], places) is None
            assert [bytes(b) for b in buffers] == values
        _still_in_step(client, kv_server, before, reused=True)
    finally:
        if front is not None:
            front.close()


def test_places_into_one_buffer_are_written_where_they_lie(kv_server):
    client = _client(kv_server)
    client.set("a", b"A" * 70000)
    client.set("b", b"B" * 3)
    out = bytearray(70003)
    view = memoryview(out)
    assert get_into(client, ["b", "a"], [view[70000:], view[:70000]]) is None
    assert bytes(out) == b"A" * 70000 + b"B" * 3


@pytest.mark.parametrize("missing_at", [0, 2, 4])
def test_a_missing_key_is_unfit_with_no_length_and_the_connection_is_not_reused(kv_server, missing_at):
    client = _client(kv_server)
    keys = [f"k{i}" for i in range(5)]
    for i, key in enumerate(keys):
        if i != missing_at:
            client.set(key, b"x" * (100000 + i))
    _, places = _places([100000 + i for i in range(5)])
    before = client.client_id()
    assert get_into(client, keys, places) == Unfit(missing_at, None)
    _still_in_step(client, kv_server, before, reused=False)


def test_a_value_of_another_length_is_unfit_with_its_length(kv_server):
    client = _client(kv_server)
    client.set("short", b"s" * 10)
    client.set("long", b"l" * 200000)
    client.set("after", b"a" * 5)
    _, places = _places([10, 100000, 5])
    before = client.client_id()
    assert get_into(client, ["short", "long", "after"], places) == Unfit(1, 200000)
    _still_in_step(client, kv_server, before, reused=False)
    _, places = _places([11])
    before = client.client_id()
    assert get_into(client, ["short"], places) == Unfit(0, 10)
    _still_in_step(client, kv_server, before, reused=False)


def test_a_server_error_raises_and_the_client_goes_on(kv_server):
    client = _client(kv_server)
    client.set("fine", b"f" * 40000)
    client.hset("a-hash", "field", "value")
    _, places = _places([40000, 5, 40000])
    before = client.client_id()
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        get_into(client, ["fine", "a-hash", "fine"], places)
    _still_in_step(client, kv_server, before, reused=False)


def test_a_silent_server_raises_a_timeout_and_the_client_works_once_it_answers(kv_server):
    client = _client(kv_server, timeout=1.0)   # what a silent server costs; ample for a loaded machine
    client.set("v", b"v" * 300000)
    before = client.client_id()
    kv_server.pause()
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            get_into(client, ["v"], _places([300000])[1])
    finally:
        kv_server.resume()
    buffers, places = _places([300000])
    assert get_into(client, ["v"], places) is None and bytes(buffers[0]) == b"v" * 300000
    _still_in_step(client, kv_server, before, reused=False)


def test_a_server_gone_raises_a_connection_error(kv_server):
    client = _client(kv_server)
    client.set("v", b"v")
    kv_server.kill()
    with pytest.raises(redis.exceptions.ConnectionError):
        get_into(client, ["v"], _places([1])[1])


def test_keys_and_places_must_pair_up(kv_server):
    with pytest.raises(ValueError, match="2 keys for 1 places"):
        get_into(_client(kv_server), ["a", "b"], _places([1])[1])


class _Scripted:
    """A loopback peer that answers each GET with ``reply`` (and any other command, such as the
    client's CLIENT SETINFO on connecting, with +OK), then closes if ``close_after``: replies no
    real server sends, for the reader's framing. It counts the connections it saw closed."""

    def __init__(self, reply: bytes, close_after: bool = False, drop_first: bool = False) -> None:
        self.reply, self.close_after, self.closed = reply, close_after, 0
        self.drop_first = drop_first   # the first connection is closed at its first GET, unanswered
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, socket_connect_timeout=5, protocol=2)

    def _serve(self) -> None:
        while True:
            try:
                peer, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(peer,), daemon=True).start()

    def _answer(self, peer: socket.socket) -> None:
        stream = peer.makefile("rb")
        try:
            while line := stream.readline():   # *N, then N times $len and the argument
                words = []
                for _ in range(int(line[1:])):
                    size = int(stream.readline()[1:])
                    words.append(stream.read(size + 2)[:-2])
                if words[0].upper() != b"GET":
                    peer.sendall(b"+OK\r\n")
                    continue
                if self.drop_first:
                    self.drop_first = False
                    break
                peer.sendall(self.reply)
                if self.close_after:
                    break
        except OSError:
            pass
        finally:
            self.closed += 1
            peer.close()

    def wait_closed(self, otherwise: str) -> None:
        """Return once the client closed a connection (within a bound, not a speed)."""
        deadline = time.monotonic() + 10
        while self.closed < 1:
            assert time.monotonic() < deadline, otherwise
            time.sleep(0.02)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("reply, close_after, raised", [
    (b"$10\r\nabc", True, redis.exceptions.ConnectionError),        # a value cut short by a close
    (b"$12", True, redis.exceptions.ConnectionError),                # a header cut short
    (b"$abc\r\n", False, redis.exceptions.InvalidResponse),          # a length that is no number
    (b"$--1\r\n", False, redis.exceptions.InvalidResponse),
    (b">2\r\n$4\r\npush\r\n$1\r\nx\r\n", False, redis.exceptions.InvalidResponse),   # RESP3 push
    (b"+OK\r\n", False, redis.exceptions.InvalidResponse),           # no reply GET gives
    (b"$3\r\nabcXY\r\n", False, redis.exceptions.InvalidResponse),       # a value longer than its header
])
def test_a_reply_no_server_should_send_raises_and_closes_the_connection(reply, close_after, raised):
    peer = _Scripted(reply, close_after)
    try:
        with pytest.raises(raised):
            get_into(peer.client(), ["k"], [memoryview(bytearray(3 if reply.startswith(b"$3") else 10))])
        peer.wait_closed("the connection was left open")
    finally:
        peer.close()


def test_bytes_after_the_last_reply_keep_the_connection_from_the_pool():
    peer = _Scripted(b"$3\r\nabc\r\n>1\r\n$4\r\nmore\r\n")
    try:
        place = bytearray(3)
        assert get_into(peer.client(), ["k"], [memoryview(place)]) is None and bytes(place) == b"abc"
        peer.wait_closed("a connection with bytes unread went back to the pool")
    finally:
        peer.close()


def test_a_connection_lost_before_its_replies_is_tried_once_more_on_a_fresh_one():
    peer = _Scripted(b"$3\r\nabc\r\n", drop_first=True)
    try:
        place = bytearray(3)
        assert get_into(peer.client(), ["k"], [memoryview(place)]) is None and bytes(place) == b"abc"
        assert peer.closed >= 1 and not peer.drop_first
    finally:
        peer.close()
