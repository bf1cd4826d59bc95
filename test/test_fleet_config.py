"""Configuring the fleet tier: a capsule key is required, the URL carries no password or
timeouts of its own, a password and an ACL user work against a real server, and bad values
are refused with a message that names them."""
from __future__ import annotations

import pytest

from fleet_harness import KEY, engine, snapshot, tier
from flashrt_ros.capsule import CapsuleError
from flashrt_ros.capsule.fleet import FleetTier
from flashrt_ros.errors import ErrorCode, InvalidArgument


@pytest.mark.parametrize("key", [None, b"", b"short", "a string key of 32 characters...."])
def test_the_fleet_tier_requires_a_capsule_key(key):
    with pytest.raises(InvalidArgument, match="requires a capsule key"):
        FleetTier("redis://127.0.0.1:6379/0", key)


@pytest.mark.parametrize("url, options, message", [
    ("http://host:6379", {}, "use redis://"),
    ("redis://user:secret@host:6379/0", {}, "put it in password_file"),
    ("redis://host:6379/0?socket_timeout=100", {}, "timeout_s and connect_timeout_s bound every call"),
    ("redis://robot@host:6379/0", {"username": "other"}, "username is given twice"),
    ("redis://host:6379/0?protocol=3", {}, "protocol=3: the fleet tier speaks RESP2"),
    ("redis://host:6379/0", {"prefix": "a:b"}, "fleet prefix 'a:b'"),
    ("redis://host:6379/0", {"prefix": "fleet*"}, "fleet prefix"),
    ("redis://host:6379/0", {"timeout_s": 0}, "timeout_s must be"),
    ("redis://host:6379/0", {"chunk_bytes": 100}, "chunk_bytes must be an int in [4096, 67108864]"),
    ("redis://host:6379/0", {"chunk_rows": 0}, "chunk_rows"),
    ("redis://host:6379/0", {"node": "two words"}, "node id"),
    ("redis://host:6379/0", {"colour": "blue"}, "unexpected keyword argument 'colour'"),
])
def test_a_bad_configuration_is_refused_with_a_message_that_names_it(url, options, message):
    with pytest.raises(InvalidArgument) as refused:
        FleetTier(url, KEY, **options)
    assert message in str(refused.value)


def test_a_tls_url_is_taken_without_connecting():
    fleet = FleetTier("rediss://fleet.example:6380/0?ssl_ca_certs=/etc/ssl/ca.pem", KEY)
    assert fleet.config.url.startswith("rediss://")


def test_a_password_from_a_file_and_an_acl_user_work_and_a_wrong_password_is_fleet_unavailable(kv_server, tmp_path):
    client = kv_server.client()
    # The categories docs/fleet.md recommends, not +@all.
    client.execute_command("ACL", "SETUSER", "robot7", "on", ">s3cret-pass", "~flashrt:*", "+@read", "+@write",
                           "+@scripting", "+@keyspace", "+@connection", "+time")
    good, bad = tmp_path / "password", tmp_path / "wrong"
    good.write_text("s3cret-pass\n")
    bad.write_text("guess\n")
    url = f"redis://robot7@127.0.0.1:{kv_server.port}/0"
    a = engine()
    a.prefill([1, 2, 3, 4])
    taken = snapshot(a, "acl")
    robot = FleetTier(url, KEY, password_file=str(good), node="a", chunk_rows=8, chunk_bytes=16384)
    robot.publish(a.capsules, taken.id)
    b = engine()
    b.restore(robot.pull(b.capsules, "acl").id)
    assert [c.info.id for c in robot.list()] == [taken.id]
    robot.hold("acl", ttl_s=60)
    assert robot.drop("acl") is True and robot.collect().manifests == 0
    with pytest.raises(CapsuleError) as refused:
        FleetTier(url, KEY, password_file=str(bad)).ping()
    assert refused.value.code == ErrorCode.FLEET_UNAVAILABLE and "credentials" in str(refused.value)
    # The ACL keeps this user to its own prefix: another one is refused, with the reason.
    with pytest.raises(CapsuleError) as refused:
        FleetTier(url, KEY, prefix="elsewhere", password_file=str(good)).publish(a.capsules, taken.id)
    assert refused.value.code == ErrorCode.FLEET_UNAVAILABLE and "ACL" in str(refused.value)


def test_a_password_file_that_is_missing_or_not_a_file_is_refused(tmp_path):
    for path in (tmp_path / "absent", tmp_path):
        with pytest.raises(InvalidArgument, match="fleet password file"):
            FleetTier("redis://127.0.0.1:1/0", KEY, password_file=str(path)).ping()


def test_a_key_of_another_type_under_the_prefix_is_refused_before_anything_is_written(kv_server):
    a = engine()
    a.prefill([1, 2, 3])
    taken = snapshot(a, "typed")
    client = kv_server.client()
    client.set("flashrt:holders:" + taken.id, b"not a sorted set")
    with pytest.raises(CapsuleError) as refused:
        tier(kv_server, "a").publish(a.capsules, taken.id)
    assert refused.value.code == ErrorCode.IO_ERROR and "another application" in str(refused.value)
    assert not client.exists(f"flashrt:manifest:{taken.id}", "flashrt:name:typed")
