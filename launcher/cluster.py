"""``pdserve up``: a complete cluster on this machine with one command.

    pdserve up                                      # shm arena, router, 1 prefill + 1 decode
    pdserve up --prefill 2 --decode 2 --kv-store redis
    pdserve up --autoscale --prefill-max 4 --decode-max 4 --slo ttft=500,tpot=50
    pdserve up --demo                               # start, sample traffic + SLO report, stop

Start: the router's ports are claimed first (``launcher.ports``: a busy one is one line naming
the flag that changes it; ``--demo`` takes free ones). A built-in model is generated once, here,
rather than by every process at once. Then the KV store (``shm``, the default: one preallocated
shared-memory arena in a fresh directory under /dev/shm, ``--kv-store-capacity`` big; ``file``: a
file per entry there; ``redis``: a private ``redis-server`` on a free port with persistence off and
``allkeys-lru``; or any store URL), and the router and the nodes at the same time (the nodes know
the router's gRPC port in advance and register as soon as both are up) - or, with
``--autoscale``, the router, whose local actuator starts the nodes so that the autoscaler owns
every node. Once the router's ``/ready`` is ready and counts every node, the endpoints are printed.

Serve: `up` supervises (``launcher.supervisor``): the router (on the same, held ports), a private
Redis and, without ``--autoscale``, the nodes (through the local actuator) are restarted with
backoff when they exit unexpectedly; the cluster stops only when asked, or when what keeps
exiting leaves nothing that can serve.

Stop (Ctrl-C, SIGTERM, SIGHUP, or the end of ``--demo``): SIGTERM to every child - nodes drain,
the router lets in-flight requests finish - then SIGKILL to whatever of the cluster is left, found
by its environment marker (``launcher.processes``); the private Redis and the temporary directory
go too. A second Ctrl-C skips the waiting. If `up` dies instead (SIGKILL, a crash), its children
die with it (parent-death signal) and its reaper (``launcher.reaper``) removes the rest; a state
file (``launcher.state``) lets ``pdserve down`` stop a cluster that is still left. Children get
``PDSERVE_*`` variables scrubbed: `up` passes every setting as a flag (the API key as
``PDSERVE_API_KEY`` to the router only, off argv), and ``TMPDIR`` inside the cluster's directory,
so their temporary files go with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from launcher.actuators import LocalProcessActuator, NodeLaunch
from launcher.cluster_config import ClusterConfig, add_arguments, check_model
from launcher.local_store import restart_redis, shown, start_kv_store
from launcher.ports import (
    HeldPort,
    PortInUse,
    PortSpec,
    bind_failure,
    busy_message,
    hold_router_ports,
)
from launcher.processes import (
    ManagedProcess,
    StartupError,
    child_env,
    connect_host,
    kill_marked,
    last_error,
)
from launcher.reaper import Reaper
from launcher.state import (
    ClusterState,
    default_state_dir,
    process_start_time,
    remove_state,
    state_path,
    write_state,
)
from launcher.supervisor import RestartPolicy, Supervised
from launcher.watchdog import WatchdogConfig
from router.autoscale.policy import Pool, PoolLimits

DEMO_SLO = "ttft=500,tpot=50"  # the demo's SLOs when --slo is not given

_ROUTER_STOP_S = 60.0
_STRAGGLER_GRACE_S = 3.0  # after a graceful stop, for helpers that exit with their parent
_READY_POLL_S = 0.1
_SUPERVISE_S = 0.5  # how often `up` looks for exited children once it serves


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``up`` subcommand."""
    parser = subparsers.add_parser("up", help="start a whole cluster on this machine")
    add_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no line per readiness poll
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # the demo's plots: no chatter
    try:
        config = ClusterConfig.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve up: {exc}") from None
    return asyncio.run(run(config))


def _say(text: str, err: bool = False) -> None:
    """Print one line; quietly nothing once the terminal is gone (after a SIGHUP)."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr if err else sys.stdout, flush=True)


@contextlib.contextmanager
def _actuator_quiet() -> Iterator[None]:
    """Hold back the local actuator's log lines (`up` speaks for it while not serving)."""
    log = logging.getLogger("launcher.actuators")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _workdir() -> Path:
    """A fresh directory for the file store and logs: RAM-backed /dev/shm when usable."""
    shm = Path("/dev/shm")
    parent = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=f"pdserve-{os.getpid()}-", dir=parent))


class Cluster:
    """The processes of one ``pdserve up``; :meth:`start` in order, :meth:`stop` in reverse.

    Construction makes the cluster's directory, starts its reaper and writes its state file;
    ``ports`` are the router's, held (see launcher.ports) until the router has them."""

    def __init__(
        self, config: ClusterConfig, ports: tuple[HeldPort, HeldPort], started: float
    ) -> None:
        """``started``: when `up` began (``time.monotonic()``), for the progress lines."""
        self.config = config
        self.marker = uuid.uuid4().hex
        self.workdir = _workdir()
        state_dir = Path(config.state_dir) if config.state_dir else default_state_dir()
        self.state_file = state_path(state_dir, os.getpid())
        self.reaper = Reaper(self.marker, self.workdir, self.state_file)
        self.state = ClusterState(
            os.getpid(), process_start_time(os.getpid()), self.marker, str(self.workdir)
        )
        write_state(state_dir, self.state)
        self.log_dir = Path(config.log_dir) if config.log_dir else self.workdir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "tmp").mkdir()
        self.held_ports = ports
        self.http_port, self.grpc_port = ports[0].port, ports[1].port
        self.kv_url = ""
        self.redis: ManagedProcess | None = None
        self.router: ManagedProcess | None = None
        self.nodes: LocalProcessActuator | None = None
        self.served = False  # the endpoints were printed
        self.started = started
        self.supervised: list[Supervised] = []  # the router and a private Redis, once serving

    # -- start -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start everything and wait until the router routes to every node (StartupError).

        Until then the actuator's own log lines are held back: `up` reports a failed start
        itself, in one line where it can (a port in use)."""
        with _actuator_quiet():
            await self._start()

    async def _start(self) -> None:
        self.kv_url, self.redis = await start_kv_store(
            self.config, self.workdir, self.log_dir, self._env()
        )
        self.phase(f"KV store {shown(self.kv_url)}")
        self._start_router()
        self.phase(f"router starting (logs in {self.log_dir})")
        if not self.config.autoscale:  # at the same time: they dial the router's held port
            watchdog = WatchdogConfig(self.config.node_watchdog_s, tls=self.config.node_tls())
            # fail fast first: no restarts (nor watchdog) before the cluster serves
            self.nodes = LocalProcessActuator(self._launch(), restart=None, watchdog=watchdog)
            await self.nodes.scale(Pool.PREFILL, self.config.prefill)
            await self.nodes.scale(Pool.DECODE, self.config.decode)
            self.phase(
                f"{self.config.prefill} prefill + {self.config.decode} decode node(s) starting:"
                " each loads the model, then registers"
            )
        await self._wait_router()
        self.phase(f"router serving on {self.http_url}")
        self._record_state()
        await self._wait_routable(*self._initial_counts())
        self._record_state()

    def phase(self, text: str) -> None:
        """One line of start-up progress, with the time since `up` started (not with
        ``--quiet``)."""
        if not self.config.quiet:
            _say(f"pdserve up [{time.monotonic() - self.started:5.1f}s] {text}")

    def _start_router(self) -> None:
        env = self._env()
        if self.config.api_key:  # through the environment: argv is readable by every user
            env["PDSERVE_API_KEY"] = env["PDSERVE_NODE_KEY"] = self.config.api_key
        if self.config.autoscale:  # the store URL of the nodes it starts (it may hold a password)
            env["PDSERVE_NODE_KV_STORE"] = self.kv_url
        self.router = ManagedProcess(
            "router", self._router_argv(), self.log_dir / "router.log", env
        )

    async def _wait_router(self) -> None:
        """Until the router serves (then its ports are its own); StartupError if it exits."""
        assert self.router is not None
        try:
            await self.router.wait_ready(self.config.startup_timeout_s)
        except StartupError:
            raise StartupError(self._exit_reason(self.router)) from None
        for port in self.held_ports:
            port.release()

    def _router_argv(self) -> list[str]:
        c = self.config
        argv = [sys.executable, "-m", "pdserve_cli", "router", "--model", c.model,
                "--host", c.host, "--port", str(self.http_port),
                "--grpc-port", str(self.grpc_port), *c.router_argv()]  # fmt: skip
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
            "--node-model", c.model,
            "--node-args", shlex.join(c.node_argv()), "--node-log-dir", str(self.log_dir),
            "--node-gpus", ",".join(c.gpu_ids()), "--node-drain-timeout", "30",
            "--prefill-tp", str(c.prefill_tp), "--decode-tp", str(c.decode_tp),
            "--node-watchdog", f"{c.node_watchdog_s:g}",
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
            router=f"{connect_host(self.config.host)}:{self.grpc_port}",
            kv_store=self.kv_url,
            log_dir=self.log_dir,
            model=self.config.model,
            extra_args=tuple(self.config.node_argv()),
            env=self._node_env(),
            gpus=self.config.gpu_ids(),
            prefill_tp=self.config.prefill_tp,
            decode_tp=self.config.decode_tp,
            drain_timeout_s=30.0,
            startup_timeout_s=self.config.startup_timeout_s,
        )

    def _node_env(self) -> dict[str, str]:
        """A node's environment: with --api-key, the key it registers with."""
        env = self._env()
        if self.config.api_key:
            env["PDSERVE_NODE_KEY"] = self.config.api_key
        return env

    def _env(self) -> dict[str, str]:
        return child_env(self.marker, scrub_pdserve=True, TMPDIR=str(self.workdir / "tmp"))

    def _record_state(self, only_if_changed: bool = False) -> None:
        """Rewrite the state file with the process groups known now (nodes an autoscaler
        starts are found by their marker)."""
        children = [self.redis, self.router]
        if self.nodes is not None:
            children += [process for pool in Pool for process in self.nodes.processes(pool)]
        groups = [c.pid for c in children if c is not None]
        if only_if_changed and groups == self.state.process_groups:
            return
        self.state.process_groups = groups
        self.state.http_url = self.http_url
        write_state(self.state_file.parent, self.state)

    async def _wait_routable(self, prefill: int, decode: int) -> None:
        """Poll ``/ready`` until the router is ready with ``prefill`` + ``decode`` nodes."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        seen: dict[str, int] = {}
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            while True:
                self.check_alive()
                ready, counts = await self._readiness(client)
                if counts and counts != seen:
                    seen = counts
                    self.phase(
                        f"registered: prefill {counts.get('prefill', 0)}/{prefill},"
                        f" decode {counts.get('decode', 0)}/{decode}"
                    )
                if (
                    ready
                    and counts.get("prefill", 0) >= prefill
                    and counts.get("decode", 0) >= decode
                ):
                    return
                if time.monotonic() > deadline:
                    raise StartupError(f"nodes not routable after start-up timeout: {counts}")
                await asyncio.sleep(_READY_POLL_S)

    async def _readiness(self, client: httpx.AsyncClient) -> tuple[bool, dict[str, int]]:
        """``/ready``'s verdict and instance counts (503 while not ready, with the same body)."""
        try:
            body = (await client.get(f"{self.http_url}/ready")).json()
            return body.get("ready") is True, dict(body.get("instances", {}))
        except (httpx.HTTPError, ValueError, AttributeError):
            return False, {}

    def check_alive(self) -> None:
        """Raise StartupError (with its log) if the router or a node this process started died."""
        assert self.router is not None
        if not self.router.alive:
            raise StartupError(self._exit_reason(self.router))
        if self.nodes is not None:
            wanted = {Pool.PREFILL: self.config.prefill, Pool.DECODE: self.config.decode}
            for pool, count in wanted.items():
                exited = [p for p in self.nodes.processes(pool) if not p.alive]
                if exited and not self.served:  # at start-up: say why, in one line if it can
                    raise StartupError(self._exit_reason(exited[0]))
                if len(self.nodes.nodes(pool)) < count:  # logs and forgets crashed ones
                    raise StartupError(f"a {pool.value} node exited; logs in {self.log_dir}")

    def _exit_reason(self, process: ManagedProcess) -> str:
        """Why a child exited, in one line: a port it could not bind, else the last error its
        log shows, and where the log is."""
        port = bind_failure(process.log_tail(200))
        if port is None:
            reason = last_error(process.log_tail(200))
            return (
                f"{process.name} exited with {process.proc.poll()}: {reason}"
                f" (log: {process.log_path})"
            )
        if process is self.router:
            spec = PortSpec("router HTTP", "--port", self.http_port)
            if port == self.grpc_port:
                spec = PortSpec("router gRPC", "--grpc-port", self.grpc_port)
            return busy_message(spec, self.config.host)
        return (
            f"{process.name} could not bind port {port or '?'} (in use): `up` gives nodes free"
            " ports unless --node-args sets --port"
        )

    # -- supervise ---------------------------------------------------------------------------
    def start_supervising(self, policy: RestartPolicy) -> None:
        """From now on restart what exits: the router, a private Redis and (without
        ``--autoscale``: with it the router's autoscaler owns the nodes) the nodes."""
        assert self.router is not None
        self.supervised = [Supervised("router", self.router, self._restart_router, policy)]
        if self.redis is not None:
            self.supervised.append(Supervised("redis", self.redis, self._restart_redis, policy))
        if self.nodes is not None:
            self.nodes.supervise(policy)

    def supervise(self) -> str | None:
        """One look at the children (restarts are scheduled in the background); the reason
        the cluster cannot serve any more, or None."""
        for child in self.supervised:
            child.check()
        if self.nodes is not None:
            for pool in Pool:
                self.nodes.nodes(pool)  # reaps, and schedules replacements
        self._record_state(only_if_changed=True)
        return self._cannot_serve()

    def _cannot_serve(self) -> str | None:
        """Why nothing can serve: the router given up, or a pool given up with none left (a
        prefill pool only when the router may not fall back to decode nodes)."""
        if self.supervised and self.supervised[0].gave_up:
            return "the router keeps exiting"
        if self.nodes is None:
            return None
        fallback = "--no-prefill-fallback" not in self.config.router_args
        for pool in self.nodes.gave_up:
            if not self.nodes.nodes(pool) and not (pool is Pool.PREFILL and fallback):
                return f"every {pool.value} node keeps exiting"
        return None

    async def _restart_router(self) -> ManagedProcess:
        """The router again on the same ports (held meanwhile: see launcher.ports); the nodes
        re-register with it on their next heartbeat."""
        try:
            self.held_ports = hold_router_ports(self.config.host, self.http_port, self.grpc_port)
        except PortInUse as exc:
            raise StartupError(str(exc)) from None
        self._start_router()
        assert self.router is not None
        try:
            await self._wait_router()
        except StartupError:
            self.router.kill_group()
            for port in self.held_ports:
                port.release()
            raise
        self._record_state()
        return self.router

    async def _restart_redis(self) -> ManagedProcess:
        """The private redis-server again on the same port (empty: a miss is recomputed)."""
        self.redis = await restart_redis(self.config, self.workdir, self.log_dir, self._env(),
                                         self.kv_url)  # fmt: skip
        self._record_state()
        return self.redis

    # -- report ------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"http://{connect_host(self.config.host)}:{self.http_port}"

    def describe(self) -> str:
        """The endpoints, for humans."""
        c = self.config
        lines = [
            f"pdserve cluster up: {c.model} on {c.device_name()}, {self._pools()}",
            f"  OpenAI HTTP  {self.http_url}/v1   (/health, /ready, /metrics, /slo)",
            f"  gRPC         {c.host}:{self.grpc_port}   (pdserve.v1.RouterService/Generate)",
            f"  KV store     {shown(self.kv_url)}",
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
        auth = " -H 'Authorization: Bearer <your --api-key>'" if self.config.api_key else ""
        body = json.dumps({"model": self.config.served_name, "prompt": "Hello", "max_tokens": 16})
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
        for port in self.held_ports:
            port.release()
        shutil.rmtree(self.workdir, ignore_errors=True)  # logs live there unless --log-dir
        remove_state(self.state_file)
        self.reaper.dismiss()
        return killed

    async def _stop_gracefully(self) -> None:
        await asyncio.gather(*(child.cancel() for child in self.supervised))
        stops = []
        if self.router is not None:
            stops.append(self.router.stop(_ROUTER_STOP_S))
        if self.nodes is not None:
            stops.append(self.nodes.close())
        await asyncio.gather(*stops, return_exceptions=True)
        if self.redis is not None:
            await self.redis.stop(5.0)


async def run(config: ClusterConfig) -> int:
    """Start the cluster, serve until a signal (or run the demo), stop; the exit status."""
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, lambda: (force if stop.is_set() else stop).set())
    started = time.monotonic()
    try:
        ports = hold_router_ports(config.host, config.port, config.grpc_port)
    except PortInUse as exc:
        _say(f"pdserve up: {exc}", err=True)
        return 1
    try:  # what the model's config can refuse, refused before any process starts
        model = await asyncio.to_thread(check_model, config)
    except ValueError as exc:
        _say(f"pdserve up: {exc}", err=True)
        for port in ports:
            port.release()
        return 1
    if not config.quiet:
        _say(f"pdserve up [{time.monotonic() - started:5.1f}s] model {config.model}: {model}")
    cluster = Cluster(config, ports, started)
    code = 0
    try:
        code = await _serve(cluster, stop)
    except StartupError as exc:
        _say(f"pdserve up: {exc}", err=True)
        code = 1
    finally:
        if cluster.served or stop.is_set():
            _say("pdserve up: stopping the cluster")
        with contextlib.nullcontext() if cluster.served else _actuator_quiet():
            killed = await cluster.stop(force)
        if killed:
            _say(f"pdserve up: killed {len(killed)} process(es) that did not stop")
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
    cluster.served = True
    _say(cluster.describe())
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
    _say("Ctrl-C stops the cluster.")
    cluster.start_supervising(RestartPolicy())
    while not stop.is_set():
        reason = cluster.supervise()
        if reason is not None:
            _say(f"pdserve up: {reason}: nothing can serve; logs in {cluster.log_dir}", err=True)
            return 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), _SUPERVISE_S)
    return 0


async def _demo(cluster: Cluster) -> int:
    from bench.slo import parse_slo  # the demo's imports stay out of `pdserve up --help`
    from launcher.cluster_demo import DemoLoad, run_demo

    c = cluster.config
    load = DemoLoad(num_requests=c.demo_requests)
    try:
        slo = parse_slo(c.slo or DEMO_SLO)  # a report without SLOs has no goodput to show
        report = await run_demo(cluster.http_url, c.served_name, c.api_key, slo, load)
    except httpx.HTTPError as exc:
        _say(f"pdserve up --demo: request failed: {exc}", err=True)
        return 1
    return 0 if report.num_failed == 0 else 1
