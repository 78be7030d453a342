"""Shared pytest fixtures.

Redis: every test that needs Redis gets its own `redis-server` on a free port, bound to 127.0.0.1,
with persistence off (so `restart()` comes back empty) and its files in a temp dir. The system
Redis on 6379 is never touched.
"""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when kernels are decorated, i.e. at first import of triton: set it
# before any test module imports it, so the Triton kernels run on CPU in the interpreter.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server process. `kill()` stops it; `restart()` brings it back, empty, on
    the same port with the same settings."""

    def __init__(
        self, workdir: Path, extra_args: tuple[str, ...] = (), password: str | None = None
    ) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.password = password
        auth = f":{password}@" if password else ""
        self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        self._args = extra_args + (("--requirepass", password) if password else ())
        self._proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.workdir), *self._args]
        self._proc = subprocess.Popen(
            cmd, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with self.client() as client:
                    client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password)


@pytest.fixture
def redis_server_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisServer]]:
    """`start(*extra_args, maxmemory="8mb", policy="allkeys-lru", password=None)` → a new
    RedisServer, killed at teardown."""
    servers: list[RedisServer] = []

    def start(
        *extra: str,
        maxmemory: str | None = None,
        policy: str | None = None,
        password: str | None = None,
    ) -> RedisServer:
        args = list(extra)
        if maxmemory is not None:
            args += ["--maxmemory", maxmemory]
        if policy is not None:
            args += ["--maxmemory-policy", policy]
        server = RedisServer(tmp_path_factory.mktemp("redis"), tuple(args), password)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.kill()


@pytest.fixture
def redis_server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A fresh, empty redis-server for one test."""
    return redis_server_factory()
