"""Pipelined GETs read straight into their places (``fleet_receive``), against a real server:
values of every size around the reader's buffer land whole; a missing key, a value of
another length, a server error and a silent server each end the call clearly, and none
leaves a reply in flight on a connection the client uses next."""
import os

import pytest
import redis

from fleet_harness import TlsFront
from flashrt_ros.capsule.fleet_receive import _BUFFER, _DIRECT, Unfit, get_into


def _client(server, timeout: float = 10) -> redis.Redis:
    if isinstance(server, TlsFront):
        return redis.Redis.from_url(server.url, socket_timeout=timeout, socket_connect_timeout=10)
    return redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=timeout, socket_connect_timeout=10)


def _places(sizes):
    buffers = [bytearray(b"\xee" * n) for n in sizes]
    return buffers, [memoryview(b) for b in buffers]


def _still_in_step(client: redis.Redis, connection_before: int, reused: bool) -> None:
    """The connection went back to the pool (``reused``: the server knows it by the same id)
    or was closed, and the client's next commands get their own replies."""
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
    client = _client(front or kv_server)
    values = [os.urandom(n) for n in SIZES]
    for i, v in enumerate(values):
        client.set(f"k{i}", v)
    before = client.client_id()
    for _ in range(2):   # the second call takes the connection the first gave back
        buffers, places = _places(SIZES)
        assert get_into(client, [f"k{i}" for i in range(len(SIZES))], places) is None
        assert [bytes(b) for b in buffers] == values
    _still_in_step(client, before, reused=True)
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
    _still_in_step(client, before, reused=False)


def test_a_value_of_another_length_is_unfit_with_its_length(kv_server):
    client = _client(kv_server)
    client.set("short", b"s" * 10)
    client.set("long", b"l" * 200000)
    client.set("after", b"a" * 5)
    _, places = _places([10, 100000, 5])
    before = client.client_id()
    assert get_into(client, ["short", "long", "after"], places) == Unfit(1, 200000)
    _still_in_step(client, before, reused=False)
    _, places = _places([11])
    before = client.client_id()
    assert get_into(client, ["short"], places) == Unfit(0, 10)
    _still_in_step(client, before, reused=False)


def test_a_server_error_raises_and_the_client_goes_on(kv_server):
    client = _client(kv_server)
    client.set("fine", b"f" * 40000)
    client.hset("a-hash", "field", "value")
    _, places = _places([40000, 5, 40000])
    before = client.client_id()
    with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
        get_into(client, ["fine", "a-hash", "fine"], places)
    _still_in_step(client, before, reused=False)


def test_a_silent_server_raises_a_timeout_and_the_client_works_once_it_answers(kv_server):
    client = _client(kv_server, timeout=0.3)
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
    _still_in_step(client, before, reused=False)


def test_a_server_gone_raises_a_connection_error(kv_server):
    client = _client(kv_server)
    client.set("v", b"v")
    kv_server.kill()
    with pytest.raises(redis.exceptions.ConnectionError):
        get_into(client, ["v"], _places([1])[1])


def test_keys_and_places_must_pair_up(kv_server):
    with pytest.raises(ValueError, match="2 keys for 1 places"):
        get_into(_client(kv_server), ["a", "b"], _places([1])[1])
