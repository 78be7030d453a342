"""A Compose project of compose.yaml + compose.cpu.yaml on this machine's Docker engine, as the
live compose tests drive it: `docker compose` commands, containers by service, the router's view.

Only the router publishes ports, on 127.0.0.1 (free ports picked here); every other address is
a container on the project's own bridge network.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
FILES = ("compose.yaml", "compose.cpu.yaml")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def docker(*args: str, timeout: float = 120.0, check: bool = True) -> str:
    """``docker ARGS``; its stdout. Raises with docker's stderr when it fails and ``check``."""
    done = subprocess.run(
        ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip()[-2000:]}")
    return done.stdout


@dataclass
class ComposeProject:
    """One project (``-p name``); ``env`` is what compose.yaml's ``${PDSERVE_*}`` read."""

    name: str
    env: dict[str, str]
    extra_files: tuple[str, ...] = ()
    http_port: int = field(default_factory=free_port)
    grpc_port: int = field(default_factory=free_port)

    def __post_init__(self) -> None:
        self.env = {**self.env, "PDSERVE_BIND": "127.0.0.1",
                    "PDSERVE_HTTP_PORT": str(self.http_port),
                    "PDSERVE_GRPC_PORT": str(self.grpc_port)}  # fmt: skip

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def compose(self, *args: str, timeout: float = 300.0) -> str:
        files = [arg for name in (*FILES, *self.extra_files) for arg in ("-f", str(REPO / name))]
        done = subprocess.run(
            ["docker", "compose", "-p", self.name, *files, *args],
            capture_output=True, text=True, timeout=timeout, env=self.env, cwd=REPO, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)}: {done.stderr.strip()[-3000:]}")
        return done.stdout

    def up(self, *args: str, timeout: float = 300.0) -> None:
        """``up -d`` with the images already built: nothing is built or pulled."""
        self.compose("up", "-d", "--no-build", "--pull", "never", *args, timeout=timeout)

    def down(self) -> None:
        """Containers, networks and volumes of the project go (images stay: they are the cache)."""
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "10", timeout=180)

    def containers(self, service: str) -> list[str]:
        """Ids of the service's running containers."""
        return self.compose("ps", "-q", service).split()

    def network(self, name: str = "default") -> str:
        """The project's network ``name`` (compose.yaml: ``default``, the router's and the
        nodes'; ``kv``, Redis's and the nodes')."""
        return f"{self.name}_{name}"

    def logs(self, tail: int = 40, *services: str) -> str:
        try:
            return self.compose("logs", "--no-color", "--tail", str(tail), *services, timeout=60)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            return f"(no logs: {exc})"

    def ready(self) -> tuple[bool, dict[str, int]]:
        """The router's ``/ready``: ready, and instances per pool ((False, {}) if it is down)."""
        try:
            body = httpx.get(f"{self.base_url}/ready", timeout=3.0, trust_env=False).json()
        except (httpx.HTTPError, json.JSONDecodeError):
            return False, {}
        return body.get("ready") is True, dict(body.get("instances", {}))

    def wait_instances(self, prefill: int, decode: int, timeout_s: float) -> float:
        """Seconds until ``/ready`` is ready with exactly these pool sizes."""
        start = time.monotonic()
        want = {"prefill": prefill, "decode": decode}
        seen: dict[str, int] = {}
        while time.monotonic() - start < timeout_s:
            ready, seen = self.ready()
            if ready and all(seen.get(pool) == n for pool, n in want.items()):
                return time.monotonic() - start
            time.sleep(0.5)
        raise TimeoutError(
            f"router not at {want} within {timeout_s:.0f} s (last: {seen})\n{self.logs()}"
        )
