"""``pdserve up``: a complete cluster on this machine with one command.

    pdserve up                                      # shm arena, router, 1 prefill + 1 decode
    pdserve up --prefill 2 --decode 2 --kv-store redis
    pdserve up --autoscale --prefill-max 4 --decode-max 4 --slo ttft=500,tpot=50
    pdserve up --demo                               # start, sample traffic + SLO report, stop

Start order: the KV store (``shm``, the default: one preallocated shared-memory arena in a fresh
directory under /dev/shm, ``--kv-store-capacity`` big; ``file``: a file per entry there;
``redis``: a private ``redis-server`` on a free port with persistence off and ``allkeys-lru``; or
any store URL), the router, then the nodes - started here, or with ``--autoscale`` by the
router's local actuator so that the autoscaler owns every node. Once the router's ``/health``
counts every node, the endpoints are printed.

Stop (Ctrl-C, SIGTERM, or the end of ``--demo``): SIGTERM to every child - nodes drain, the router
lets in-flight requests finish - then SIGKILL to whatever of the cluster is left, found by its
environment marker (``router.processes``); the private Redis and the temporary directory go too.
A second Ctrl-C skips the waiting. Children get ``PDSERVE_*`` variables scrubbed: `up` passes
every setting as a flag (the API key as ``PDSERVE_API_KEY`` to the router only, off argv).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from router.actuators import LocalProcessActuator, NodeLaunch
from router.autoscaler import Pool, PoolLimits
from router.cluster_config import ClusterConfig, add_arguments
from router.cluster_demo import DemoLoad, run_demo
from router.processes import (
    ManagedProcess,
    StartupError,
    child_env,
    connect_host,
    kill_marked,
)
from router.slo import parse_slo

DEMO_SLO = "ttft=500,tpot=50"  # the demo's SLOs when --slo is not given

_ROUTER_STOP_S = 60.0
_STRAGGLER_GRACE_S = 3.0  # after a graceful stop, for helpers that exit with their parent


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add ``up`` (and ``health``, the probe its containers' healthchecks use)."""
    from router import health_check

    parser = subparsers.add_parser("up", help="start a whole cluster on this machine")
    add_arguments(parser)
    parser.set_defaults(func=main)
    health_check.register(subparsers)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per readiness poll
    try:
        config = ClusterConfig.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve up: {exc}") from None
    return asyncio.run(run(config))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _workdir() -> Path:
    """A fresh directory for the file store and logs: RAM-backed /dev/shm when usable."""
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=f"pdserve-{os.getpid()}-", dir=parent))


def _store_capacity(workdir: Path, asked: str) -> int:
    """Bytes for a local store: as asked, but at most a quarter of the filesystem it lives on
    (the shm arena allocates all of it up front)."""
    from kv_store.url import parse_size  # light: no torch

    st = os.statvfs(workdir)
    return min(parse_size(asked), st.f_frsize * st.f_blocks // 4)


class Cluster:
    """The processes of one ``pdserve up``; :meth:`start` in order, :meth:`stop` in reverse."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.marker = uuid.uuid4().hex
        self.workdir = _workdir()
        self.log_dir = Path(config.log_dir) if config.log_dir else self.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.kv_url = ""
        self.redis: ManagedProcess | None = None
        self.router: ManagedProcess | None = None
        self.nodes: LocalProcessActuator | None = None
        self.http_port = self.grpc_port = 0

    # -- start -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start everything and wait until the router routes to every node (StartupError)."""
        self.kv_url = await self._start_kv_store()
        await self._start_router()
        if not self.config.autoscale:
            self.nodes = LocalProcessActuator(self._launch())
            await self.nodes.scale(Pool.PREFILL, self.config.prefill)
            await self.nodes.scale(Pool.DECODE, self.config.decode)
        await self._wait_routable(*self._initial_counts())

    async def _start_kv_store(self) -> str:
        spec = self.config.kv_store
        if spec in ("shm", "file"):
            (self.workdir / "kv").mkdir()
            capacity = _store_capacity(self.workdir, self.config.kv_store_capacity)
            return f"{spec}://{self.workdir / 'kv'}?capacity={capacity}"
        if spec != "redis":
            return spec
        port = _free_port()
        argv = [shutil.which("redis-server") or "redis-server", "--port", str(port),
                "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--maxmemory", self.config.redis_maxmemory,
                "--maxmemory-policy", "allkeys-lru", "--dir", str(self.workdir)]  # fmt: skip
        self.redis = ManagedProcess("redis", argv, self.log_dir / "redis.log", self._env())
        await _wait_redis(self.redis, port, self.config.startup_timeout_s)
        return f"redis://127.0.0.1:{port}/0"

    async def _start_router(self) -> None:
        env = self._env()
        if self.config.api_key:
            env["PDSERVE_API_KEY"] = self.config.api_key
        self.router = ManagedProcess(
            "router", self._router_argv(), self.log_dir / "router.log", env
        )
        info = await self.router.wait_ready(self.config.startup_timeout_s)
        self.http_port, self.grpc_port = int(info["http_port"]), int(info["grpc_port"])

    def _router_argv(self) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "common.cli", "router", "--model", c.model,
                "--host", c.host, "--port", str(c.port), "--grpc-port", str(c.grpc_port)]  # fmt: skip
        if c.slo:
            argv += ["--slo", c.slo]
        if c.autoscale:
            argv += self._autoscale_argv()
        return argv + list(c.router_args)

    def _autoscale_argv(self) -> list[str]:
        c = self.config
        prefill, decode = self._limits()
        return [
            "--autoscale", "--actuator", "local",
            "--prefill-min", str(prefill.minimum), "--prefill-max", str(prefill.maximum),
            "--prefill-initial", str(prefill.start),
            "--decode-min", str(decode.minimum), "--decode-max", str(decode.maximum),
            "--decode-initial", str(decode.start),
            "--node-kv-store", self.kv_url, "--node-model", c.model,
            "--node-args", shlex.join(c.node_argv()), "--node-log-dir", str(self.log_dir),
            "--node-gpus", ",".join(c.gpus), "--node-drain-timeout", "30",
        ]  # fmt: skip

    def _limits(self) -> tuple[PoolLimits, PoolLimits]:
        """Autoscaled pools: bounds, with ``--prefill``/``--decode`` as the clamped start."""
        c = self.config
        prefill = PoolLimits(c.prefill_min, c.prefill_max)
        decode = PoolLimits(c.decode_min, c.decode_max)
        return (
            PoolLimits(prefill.minimum, prefill.maximum, prefill.clamp(c.prefill)),
            PoolLimits(decode.minimum, decode.maximum, decode.clamp(c.decode)),
        )

    def _initial_counts(self) -> tuple[int, int]:
        if not self.config.autoscale:
            return self.config.prefill, self.config.decode
        prefill, decode = self._limits()
        return prefill.start, decode.start

    def _launch(self) -> NodeLaunch:
        return NodeLaunch(
            router=f"127.0.0.1:{self.grpc_port}",
            kv_store=self.kv_url,
            log_dir=self.log_dir,
            model=self.config.model,
            extra_args=tuple(self.config.node_argv()),
            env=self._env(),
            gpus=self.config.gpus,
            drain_timeout_s=30.0,
            startup_timeout_s=self.config.startup_timeout_s,
        )

    def _env(self) -> dict[str, str]:
        return child_env(self.marker, scrub_pdserve=True)

    async def _wait_routable(self, prefill: int, decode: int) -> None:
        """Poll ``/health`` until the router has ``prefill`` + ``decode`` nodes available."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while True:
                self.check_alive()
                counts = await self._instance_counts(client)
                if counts.get("prefill", 0) >= prefill and counts.get("decode", 0) >= decode:
                    return
                if time.monotonic() > deadline:
                    raise StartupError(f"nodes not routable after start-up timeout: {counts}")
                await asyncio.sleep(0.5)

    async def _instance_counts(self, client: httpx.AsyncClient) -> dict[str, int]:
        try:
            response = await client.get(f"http://127.0.0.1:{self.http_port}/health")
            return dict(response.json().get("instances", {}))
        except (httpx.HTTPError, ValueError):
            return {}

    def check_alive(self) -> None:
        """Raise StartupError (with its log) if the router or a node this process started died."""
        assert self.router is not None
        if not self.router.alive:
            raise StartupError(f"the router exited:\n{self.router.log_tail()}")
        if self.nodes is not None:
            for pool in Pool:
                self.nodes.nodes(pool)  # logs and forgets crashed ones
            wanted = {Pool.PREFILL: self.config.prefill, Pool.DECODE: self.config.decode}
            for pool, count in wanted.items():
                if len(self.nodes.nodes(pool)) < count:
                    raise StartupError(f"a {pool.value} node exited; logs in {self.log_dir}")

    # -- report ------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{connect_host(self.config.host)}:{self.http_port}"

    def describe(self) -> str:
        """The endpoints, for humans."""
        c = self.config
        lines = [
            f"pdserve cluster up: {c.model} on {c.device_name()}, {self._pools()}",
            f"  OpenAI HTTP  {self.http_url}/v1   (/health, /metrics, /slo)",
            f"  gRPC         {c.host}:{self.grpc_port}   (pdserve.v1.RouterService/Generate)",
            f"  KV store     {self.kv_url}",
            f"  logs         {self.log_dir}",
            f"  try: {self._curl()}",
        ]
        return "\n".join(lines)

    def _pools(self) -> str:
        if not self.config.autoscale:
            return f"{self.config.prefill} prefill + {self.config.decode} decode"
        p, d = self._limits()
        return (
            f"{p.start} prefill ({p.minimum}..{p.maximum}) + "
            f"{d.start} decode ({d.minimum}..{d.maximum}), autoscaled"
        )

    def _curl(self) -> str:
        auth = ' -H "Authorization: Bearer $API_KEY"' if self.config.api_key else ""
        body = json.dumps({"model": self.config.model, "prompt": "Hello", "max_tokens": 16})
        url = f"{self.http_url}/v1/completions"
        return f"curl {url} -H 'Content-Type: application/json'{auth} -d '{body}'"

    # -- stop --------------------------------------------------------------------------------
    async def stop(self, force: asyncio.Event) -> list[int]:
        """Stop every process (gracefully unless ``force`` gets set), remove temporary files;
        returns the pids that had to be killed at the end."""
        graceful = asyncio.ensure_future(self._stop_gracefully())
        forced = asyncio.ensure_future(force.wait())
        await asyncio.wait({graceful, forced}, return_when=asyncio.FIRST_COMPLETED)
        forced.cancel()
        if not graceful.done():
            graceful.cancel()
        killed = kill_marked(self.marker, grace_s=0.0 if force.is_set() else _STRAGGLER_GRACE_S)
        for process in (self.router, self.redis):
            if process is not None:
                process.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)  # logs live there unless --log-dir
        return killed

    async def _stop_gracefully(self) -> None:
        stops = []
        if self.router is not None:
            stops.append(self.router.stop(_ROUTER_STOP_S))
        if self.nodes is not None:
            stops.append(self.nodes.close())
        await asyncio.gather(*stops, return_exceptions=True)
        if self.redis is not None:
            await self.redis.stop(5.0)


async def _wait_redis(process: ManagedProcess, port: int, timeout_s: float) -> None:
    """Until the private redis-server answers PING (StartupError if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not process.alive:
            raise StartupError(f"redis-server exited:\n{process.log_tail()}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"PING\r\n")
            reply = await reader.readline()
            writer.close()
            if reply.startswith(b"+PONG"):
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise StartupError("redis-server did not answer PING")
        await asyncio.sleep(0.05)


async def run(config: ClusterConfig) -> int:
    """Start the cluster, serve until a signal (or run the demo), stop; the exit status."""
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())
    cluster = Cluster(config)
    code = 0
    try:
        code = await _serve(cluster, stop)
    except StartupError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr)
        code = 1
    finally:
        print("pdserve up: stopping the cluster", flush=True)
        killed = await cluster.stop(force)
        if killed:
            print(f"pdserve up: killed {len(killed)} process(es) that did not stop", flush=True)
    return code


async def _serve(cluster: Cluster, stop: asyncio.Event) -> int:
    """Start (abandoned on a signal), then serve or run the demo; the exit status."""
    start = asyncio.ensure_future(cluster.start())
    signalled = asyncio.ensure_future(stop.wait())
    await asyncio.wait({start, signalled}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        return 130
    signalled.cancel()
    start.result()
    print(cluster.describe(), flush=True)
    if cluster.config.demo:
        demo = asyncio.ensure_future(_demo(cluster))
        signalled = asyncio.ensure_future(stop.wait())
        await asyncio.wait({demo, signalled}, return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        if not demo.done():
            demo.cancel()
            await asyncio.gather(demo, return_exceptions=True)
            return 130
        return demo.result()
    print("Ctrl-C stops the cluster.", flush=True)
    while not stop.is_set():
        cluster.check_alive()
        await asyncio.sleep(0.5)
    return 0


async def _demo(cluster: Cluster) -> int:
    c = cluster.config
    load = DemoLoad(num_requests=c.demo_requests)
    try:
        slo = parse_slo(c.slo or DEMO_SLO)  # a report without SLOs has no goodput to show
        report = await run_demo(cluster.http_url, c.model, c.api_key, slo, load)
    except httpx.HTTPError as exc:
        print(f"pdserve up --demo: request failed: {exc}", file=sys.stderr)
        return 1
    return 0 if report.num_failed == 0 else 1
