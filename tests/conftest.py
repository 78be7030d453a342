"""Shared pytest fixtures.

Redis: every test that needs Redis gets its own `redis-server` on a free port, bound to 127.0.0.1,
with persistence off (so `restart()` comes back empty) and its files in a temp dir. The system
Redis on 6379 is never touched.
"""

from __future__ import annotations

import os

# Triton reads TRITON_INTERPRET when kernels are decorated, i.e. at first import of triton: set it
# before any test module imports it, so the Triton kernels run on CPU in the interpreter.
# PDSERVE_TEST_DEVICE=cuda (what benchmarks/gpu_check.py sets) asks for the GPU: never interpret.
if os.environ.get("PDSERVE_TEST_DEVICE") != "cuda" and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

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


# -- Redis Cluster and TLS (appended for kv_store/redis_cluster.py) -----------------------------

REDIS_CLI = shutil.which("redis-cli") or "/usr/bin/redis-cli"


class TLSFiles(NamedTuple):
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost (PEM paths)."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(workdir: Path) -> TLSFiles:
    """Generate a CA and a CA-signed EC server certificate with the openssl CLI."""
    ca, ca_key = workdir / "ca.crt", workdir / "ca.key"
    cert, key, csr = workdir / "server.crt", workdir / "server.key", workdir / "server.csr"
    ext = workdir / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    sign = ["-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2", "-extfile", ext]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=test-ca"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", csr, *sign, "-out", cert],
    ):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True)
    return TLSFiles(ca, cert, key)


def tls_server_args(tls: TLSFiles, port: int) -> list[str]:
    """redis-server arguments for TLS only on `port` (no plain port), no client certificates."""
    files = ["--tls-cert-file", str(tls.cert), "--tls-key-file", str(tls.key)]
    files += ["--tls-ca-cert-file", str(tls.ca), "--tls-auth-clients", "no"]
    return ["--port", "0", "--tls-port", str(port), *files]


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TLSFiles:
    """Certificates for TLS tests; skips them if openssl or redis-server's TLS support is
    missing (the only reasons to skip)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to generate test certificates")
    tls = make_tls_files(tmp_path_factory.mktemp("tls"))
    probe_dir, port = tmp_path_factory.mktemp("tls-probe"), free_port()
    cmd = [REDIS_SERVER, *tls_server_args(tls, port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(cmd, cwd=probe_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=0.5)  # a build without TLS exits at once
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return tls
    pytest.skip(f"redis-server has no TLS support: {out.decode(errors='replace')[-300:]}")


class RedisClusterNodes:
    """`count` private redis-server processes in cluster mode, joined into one cluster with
    `redis-cli --cluster create` (no replicas), each owning a third of the slots. `kill(i)` stops
    node i; `url` is the store URL listing every node (`rediss+cluster://` when `tls` is given)."""

    def __init__(self, workdir: Path, count: int = 3, tls: TLSFiles | None = None) -> None:
        self.workdir, self.tls = workdir, tls
        self.ports = [free_port() for _ in range(count)]
        self._procs: list[subprocess.Popen[bytes] | None] = [self._start(p) for p in self.ports]
        nodes = [f"127.0.0.1:{p}" for p in self.ports]
        create = [REDIS_CLI, *self._cli_tls(), "--cluster", "create", *nodes]
        try:
            subprocess.run(
                [*create, "--cluster-replicas", "0", "--cluster-yes"],
                check=True, capture_output=True, timeout=30,
            )  # fmt: skip
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        scheme = "rediss+cluster" if tls else "redis+cluster"
        query = f"/?ssl_ca_certs={tls.ca}" if tls else ""
        self.url = f"{scheme}://{','.join(nodes)}{query}"

    def _start(self, port: int) -> subprocess.Popen[bytes]:
        listen = tls_server_args(self.tls, port) if self.tls else ["--port", str(port)]
        tls_bus = ["--tls-cluster", "yes"] if self.tls else []
        cmd = [REDIS_SERVER, *listen, *tls_bus, "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", str(self.workdir), "--cluster-enabled", "yes"]
        cmd += ["--cluster-config-file", f"nodes-{port}.conf", "--cluster-port", str(free_port())]
        cmd += ["--cluster-require-full-coverage", "no", "--cluster-node-timeout", "2000"]
        proc = subprocess.Popen(
            cmd, cwd=self.workdir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.client(port) as client:
                    client.ping()
                return proc
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    proc.kill()
                    raise
                time.sleep(0.02)

    def _cli_tls(self) -> list[str]:
        return ["--tls", "--cacert", str(self.tls.ca)] if self.tls else []

    def _wait_ok(self, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        for port in self.ports:
            with self.client(port) as client:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster on {self.ports} did not reach state ok")
                    time.sleep(0.05)

    def client(self, port: int) -> redis.Redis:
        """A plain client of one node (no redirection: for inspecting that node)."""
        tls = dict(ssl=True, ssl_ca_certs=str(self.tls.ca)) if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=port, **tls)  # type: ignore[arg-type]

    def kill(self, i: int) -> None:
        proc = self._procs[i]
        if proc is not None:
            proc.kill()
            proc.wait()
            self._procs[i] = None

    def stop(self) -> None:
        for i in range(len(self._procs)):
            self.kill(i)


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterNodes]:
    """A 3-node Redis Cluster shared by one test module (tests clear their own namespace)."""
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
    yield nodes
    nodes.stop()


@pytest.fixture
def redis_cluster_factory(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., RedisClusterNodes]]:
    """`start(tls=None)` → a new cluster of its own (for tests that kill nodes), stopped at
    teardown."""
    clusters: list[RedisClusterNodes] = []

    def start(tls: TLSFiles | None = None) -> RedisClusterNodes:
        clusters.append(RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"), tls=tls))
        return clusters[-1]

    yield start
    for cluster in clusters:
        cluster.stop()
