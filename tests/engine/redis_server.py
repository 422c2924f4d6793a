"""A real redis-server on a free loopback port for the shared-tier tests: no persistence, stopped afterwards; it
can be killed (SIGKILL), hung (SIGSTOP) and resumed, and restarted on the same port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

BINARY = shutil.which("redis-server")
NEEDS_REDIS = pytest.mark.skipif(BINARY is None, reason="redis-server is not installed (scripts/test.sh installs "
                                                       "Debian's redis-server package when run as root)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, folder, port: int | None = None, password: str | None = None):
        self.folder = folder
        self.port = port or free_port()
        self.password = password
        self.url = f"redis://{f':{password}@' if password else ''}127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except Exception:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=2,
                           socket_connect_timeout=2)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def running_redis(tmp_path):
    """The body of a test module's `redis_server` fixture: a started server, stopped after the test."""
    if BINARY is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs Debian's redis-server package when "
                    "run as root)")
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()
