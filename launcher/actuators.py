"""Actuators: how the autoscaler's decisions become instances. Three back ends of the router's
``Actuator`` interface (``router.autoscale.actuator``).

- :class:`LocalProcessActuator` (default): ``pdserve prefill|decode`` child processes on this
  machine that register with the router. It can pick *which* instance goes on a scale-down,
  so the autoscale loop takes that instance out of routing before it is stopped.
- :class:`ComposeActuator`: ``docker compose up -d --no-deps --no-recreate --scale SVC=N SVC``.
- :class:`KubernetesActuator`: PATCH of a Deployment's ``scale`` subresource over the API
  server's REST API (bearer token of the pod's service account).

Compose and Kubernetes choose the replicas they remove themselves; those get SIGTERM, and a
pdserve node drains on SIGTERM (deregisters, refuses new work, finishes what it runs), so no
request is dropped there either - give containers a stop grace period longer than a request.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import ssl
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import httpx
from pdserve_proto.nodes import NodeLoad

from launcher.gpus import GpuAllocator, check_tp_fits
from launcher.processes import ManagedProcess, StartupError
from launcher.supervisor import RestartBudgets, RestartPolicy, exit_cause
from launcher.watchdog import LoadProbe, NodeWatch, WatchdogConfig, probe_all
from router.autoscale.actuator import ActuatorError
from router.autoscale.policy import Pool

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- local processes


@dataclass(frozen=True)
class NodeLaunch:
    """How the local actuator starts a node: ``python -m pdserve_cli prefill|decode`` on
    127.0.0.1, an ephemeral port, registering with ``router``; ``kv_store`` goes through its
    environment (``PDSERVE_KV_STORE``: a URL may carry a password). ``extra_args`` go last (engine
    flags such as ``--device cpu --cpu-threads 1``). A pool's nodes run at its tensor-parallel
    size (``prefill_tp``/``decode_tp``); with ``gpus``, each node's ``CUDA_VISIBLE_DEVICES``
    names that many distinct GPUs, the least used (``launcher/gpus.py``)."""

    router: str
    kv_store: str
    log_dir: Path
    model: str = "tiny-llama"
    extra_args: tuple[str, ...] = ()
    env: Mapping[str, str] | None = None  # None: this process's environment
    gpus: tuple[str, ...] = ()
    drain_timeout_s: float = 300.0
    startup_timeout_s: float = 600.0
    python: str = sys.executable
    prefill_tp: int = 1
    decode_tp: int = 1

    def __post_init__(self) -> None:
        for pool in Pool:
            check_tp_fits(pool.value, self.tp_size(pool), self.gpus)

    def tp_size(self, pool: Pool) -> int:
        """The pool's tensor-parallel size: GPUs per node."""
        return self.prefill_tp if pool is Pool.PREFILL else self.decode_tp

    def argv(self, pool: Pool) -> list[str]:
        tp = self.tp_size(pool)
        return [
            self.python, "-m", "pdserve_cli", pool.value,
            "--host", "127.0.0.1", "--port", "0",
            "--router", self.router, "--model", self.model,
            "--drain-timeout", f"{self.drain_timeout_s:g}",
            "--startup-timeout", f"{self.startup_timeout_s:g}",
            *(["--tensor-parallel-size", str(tp)] if tp > 1 else []),
            *self.extra_args,
        ]  # fmt: skip


class LocalNode:
    """A node child process and, once it printed its ready line, its address."""

    def __init__(self, process: ManagedProcess, gpus: tuple[str, ...] = ()) -> None:
        self.process = process
        self.gpus = gpus  # what CUDA_VISIBLE_DEVICES names for it
        self.address: str | None = None
        self.stopping = False
        self.watch: NodeWatch | None = None  # the watchdog's, from its first probe
        self.hung: str | None = None  # why the watchdog killed it

    async def watch_start(self, timeout_s: float) -> None:
        """Record the address when ready; log (and leave for the reaper) a failed start."""
        try:
            info = await self.process.wait_ready(timeout_s)
        except StartupError as exc:
            if not self.stopping:
                logger.error("%s did not start: %s", self.process.name, exc)
                self.process.kill_group()
            return
        self.address = f"127.0.0.1:{info['port']}"
        logger.info("%s ready at %s", self.process.name, self.address)


class LocalProcessActuator:
    """Node processes on this machine, kept at the count last asked of :meth:`scale`, as a
    Deployment keeps its replicas: a node that exits unexpectedly is replaced after a backoff
    (``restart``, see ``launcher.supervisor``; None: never), and a pool whose nodes keep exiting
    is given up (``gave_up``). ``current`` counts live nodes; a replacement the autoscaler asks
    for before the backoff ends is not started twice. While it supervises, a node that hangs
    (``launcher.watchdog``) is killed, and so replaced like one that exited."""

    def __init__(
        self,
        launch: NodeLaunch,
        restart: RestartPolicy | None = RestartPolicy(),
        watchdog: WatchdogConfig = WatchdogConfig(),
    ) -> None:
        self.launch = launch
        self.restart = restart
        self.watchdog = watchdog
        self.gave_up: set[Pool] = set()
        self._nodes: dict[Pool, list[LocalNode]] = {pool: [] for pool in Pool}
        self._wanted: dict[Pool, int] = {pool: 0 for pool in Pool}
        self._budgets = {pool: RestartBudgets(restart or RestartPolicy()) for pool in Pool}
        self._tasks: set[asyncio.Task[None]] = set()
        self._respawns: set[asyncio.Task[None]] = set()
        self._watch: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closed = False
        self._serial = itertools.count()
        self.gpus = GpuAllocator(launch.gpus)

    def supervise(self, restart: RestartPolicy) -> None:
        """Replace exited nodes from now on (``pdserve up`` starts without, to fail fast)."""
        if self.restart != restart:
            self.restart = restart
            self._budgets = {pool: RestartBudgets(restart) for pool in Pool}
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._watch_nodes())
        if self._watchdog is None and self.watchdog.enabled:
            self._watchdog = asyncio.ensure_future(self._run_watchdog())

    def nodes(self, pool: Pool) -> list[LocalNode]:
        """The pool's live nodes, oldest first (read-only view for callers)."""
        self._reap(pool)
        return list(self._nodes[pool])

    def processes(self, pool: Pool) -> list[ManagedProcess]:
        """The pool's node processes, exited ones not reaped yet included (no side effect)."""
        return [n.process for n in self._nodes[pool]]

    async def current(self, pool: Pool) -> int:
        return len(self.nodes(pool))

    def choose_victims(self, pool: Pool, count: int, ranked: Sequence[str]) -> list[str]:
        owned = {node.address for node in self.nodes(pool) if node.address}
        return [address for address in ranked if address in owned][:count]

    async def scale(self, pool: Pool, replicas: int, victims: Sequence[str] = ()) -> None:
        nodes = self._nodes[pool]
        self._reap(pool)
        self._wanted[pool] = replicas
        if self.restart is not None:
            self.supervise(self.restart)
        while len(nodes) < replicas:
            nodes.append(self._spawn(pool))
        excess = len(nodes) - replicas
        if excess <= 0:
            return
        chosen = [n for n in nodes if n.address in victims][:excess]
        chosen += [n for n in reversed(nodes) if n not in chosen][: excess - len(chosen)]
        for node in chosen:
            nodes.remove(node)
            self._background(self._stop(node))

    async def close(self) -> None:
        """Stop every node (in parallel, each draining) and wait for all of them."""
        self._closed = True
        waiting = [t for t in (self._watch, self._watchdog) if t] + list(self._respawns)
        for task in waiting:
            task.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for pool in Pool:
            for node in self._nodes[pool]:
                self._background(self._stop(node))
            self._nodes[pool] = []
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, pool: Pool) -> LocalNode:
        serial = next(self._serial)
        name = f"{pool.value}-{serial}"
        env = dict(os.environ if self.launch.env is None else self.launch.env)
        env["PDSERVE_KV_STORE"] = self.launch.kv_store  # a URL may carry a password: not argv
        gpus = self.gpus.acquire(self.launch.tp_size(pool))
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        log_path = self.launch.log_dir / f"{name}.log"
        try:
            process = ManagedProcess(name, self.launch.argv(pool), log_path, env)
        except BaseException:
            self.gpus.release(gpus)
            raise
        node = LocalNode(process, gpus)
        self._background(node.watch_start(self.launch.startup_timeout_s))
        logger.info("started %s (pid %d, log %s)", name, process.pid, log_path)
        return node

    async def _stop(self, node: LocalNode) -> None:
        node.stopping = True
        name = node.process.name
        logger.info("stopping %s at %s (draining)", name, node.address or "-")
        code = await node.process.stop(self.launch.drain_timeout_s + 30.0)
        self.gpus.release(node.gpus)
        logger.info("%s stopped (%s)", name, "killed" if code is None else f"exit {code}")

    def _reap(self, pool: Pool) -> None:
        """Forget the pool's exited nodes, each replaced after the backoff (if any)."""
        for node in [n for n in self._nodes[pool] if not n.process.alive]:
            node.process.kill_orphans()
            self._nodes[pool].remove(node)
            self.gpus.release(node.gpus)
            self._replace(pool, node)

    def _replace(self, pool: Pool, node: LocalNode) -> None:
        code, name = node.process.proc.returncode, node.process.name
        tail = node.process.log_tail(10)
        if self.restart is None or pool in self.gave_up or self._closed:
            logger.warning("%s exited unexpectedly (%s):\n%s", name, code, tail)
            return
        cause = node.hung or exit_cause(node.process)
        delay = self._budgets[pool].failed(cause)
        if delay is None:
            self.gave_up.add(pool)
            logger.error("%s exited (%s): %s nodes keep exiting (%s), not replacing them; "
                         "log %s", name, code, pool.value, self._budgets[pool].describe(cause),
                         node.process.log_path)  # fmt: skip
            return
        logger.warning("%s exited unexpectedly (%s): replacing it in %.1f s:\n%s",
                       name, code, delay, tail)  # fmt: skip
        task = asyncio.ensure_future(self._respawn(pool, delay))
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _respawn(self, pool: Pool, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if not self._closed and len(self._nodes[pool]) < self._wanted[pool]:
            self._nodes[pool].append(self._spawn(pool))

    async def _watch_nodes(self, interval_s: float = 0.5) -> None:
        """Notice exits even when nobody asks for the nodes (``pdserve up`` without autoscale)."""
        while True:
            await asyncio.sleep(interval_s)
            for pool in Pool:
                self._reap(pool)

    async def _run_watchdog(self) -> None:
        """Probe every serving node each interval; kill the hung ones (``launcher.watchdog``)."""
        probe = LoadProbe(self.watchdog.rpc_timeout_s, self.watchdog.tls)
        try:
            while True:
                await asyncio.sleep(self.watchdog.interval_s)
                serving = [(pool, n) for pool in Pool for n in self._nodes[pool] if n.address]
                serving = [(pool, n) for pool, n in serving if not n.stopping and n.hung is None]
                targets = [(pool, n.address or "") for pool, n in serving]
                loads = await probe_all(probe, targets)
                now = asyncio.get_running_loop().time()
                for (_, node), load in zip(serving, loads):
                    self._judge(node, load, now)
                await probe.forget({address for _, address in targets})
        finally:
            await probe.close()

    def _judge(self, node: LocalNode, load: NodeLoad | None, now_s: float) -> None:
        """Kill ``node`` if the watchdog finds it hung (its exit is then replaced)."""
        if node.watch is None:
            node.watch = NodeWatch(self.watchdog.timeout_s, now_s)
        why = node.watch.verdict(load, now_s)
        if why is None or node.stopping or not node.process.alive:
            return
        node.hung = why
        logger.error("%s at %s is %s: killing it (log %s)",
                     node.process.name, node.address, why, node.process.log_path)  # fmt: skip
        node.process.kill_group()

    def _background(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


# --------------------------------------------------------------------------- docker compose


class CommandResult(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


CommandRunner = Callable[[Sequence[str]], Awaitable[CommandResult]]


async def run_command(argv: Sequence[str]) -> CommandResult:
    """Run ``argv`` to completion, capturing its output."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await proc.communicate()
    return CommandResult(proc.returncode or 0, out.decode(errors="replace"), err.decode())


@dataclass(frozen=True)
class ComposeTarget:
    """Which compose project and services the pools are."""

    compose_file: str | None = None
    project: str | None = None
    prefill_service: str = "prefill"
    decode_service: str = "decode"
    docker: str = "docker"

    def service(self, pool: Pool) -> str:
        return self.prefill_service if pool is Pool.PREFILL else self.decode_service

    def base(self) -> list[str]:
        argv = [self.docker, "compose"]
        if self.compose_file:
            argv += ["-f", self.compose_file]
        if self.project:
            argv += ["-p", self.project]
        return argv


class ComposeActuator:
    """Scales compose services; ``runner`` executes commands (a fake one in tests)."""

    def __init__(self, target: ComposeTarget, runner: CommandRunner = run_command) -> None:
        self.target = target
        self.runner = runner
        self._replicas: dict[Pool, int] = {}

    async def current(self, pool: Pool) -> int:
        if pool not in self._replicas:
            argv = [*self.target.base(), "ps", "-q", self.target.service(pool)]
            out = await self._run(argv)
            self._replicas[pool] = sum(1 for line in out.splitlines() if line.strip())
        return self._replicas[pool]

    def choose_victims(self, pool: Pool, count: int, ranked: Sequence[str]) -> list[str]:
        return []  # compose removes the highest-numbered replicas; they drain on SIGTERM

    async def scale(self, pool: Pool, replicas: int, victims: Sequence[str] = ()) -> None:
        service = self.target.service(pool)
        argv = [*self.target.base(), "up", "-d", "--no-deps", "--no-recreate"]
        await self._run([*argv, "--scale", f"{service}={replicas}", service])
        self._replicas[pool] = replicas

    async def close(self) -> None:
        return None  # containers outlive the router

    async def _run(self, argv: list[str]) -> str:
        result = await self.runner(argv)
        if result.returncode != 0:
            raise ActuatorError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr}")
        return result.stdout


# --------------------------------------------------------------------------- Kubernetes

_SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubernetesTarget:
    """Which Deployments the pools are, and how to reach the API server. Defaults are the
    in-cluster ones: the service account's token, CA and namespace."""

    api_url: str = "https://kubernetes.default.svc"
    namespace: str | None = None  # default: the service account's, else "default"
    prefill_deployment: str = "pdserve-prefill"
    decode_deployment: str = "pdserve-decode"
    token_file: Path = _SA_DIR / "token"
    ca_file: Path | None = None  # default: the service account's ca.crt when present

    def resolved_namespace(self) -> str:
        if self.namespace:
            return self.namespace
        path = _SA_DIR / "namespace"
        return path.read_text().strip() if path.exists() else "default"

    def scale_path(self, pool: Pool) -> str:
        name = self.prefill_deployment if pool is Pool.PREFILL else self.decode_deployment
        ns = self.resolved_namespace()
        return f"/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"


class KubernetesActuator:
    """Reads and sets ``spec.replicas`` of each pool's Deployment through its scale
    subresource (RBAC: ``get`` and ``patch`` on ``deployments/scale``). The token file is read
    on every call, so rotated service-account tokens are picked up."""

    def __init__(
        self, target: KubernetesTarget, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.target = target
        ca = target.ca_file or (_SA_DIR / "ca.crt")
        verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca)) if ca.exists() else True
        )
        self._client = httpx.AsyncClient(
            base_url=target.api_url, verify=verify, transport=transport, timeout=10.0
        )

    def _headers(self) -> dict[str, str]:
        token = self.target.token_file.read_text().strip()
        return {"Authorization": f"Bearer {token}", "Accept": "application/json"}

    async def current(self, pool: Pool) -> int:
        response = await self._request("GET", pool)
        return int(response.json().get("spec", {}).get("replicas", 0))

    def choose_victims(self, pool: Pool, count: int, ranked: Sequence[str]) -> list[str]:
        return []  # the ReplicaSet controller picks; pods drain on SIGTERM

    async def scale(self, pool: Pool, replicas: int, victims: Sequence[str] = ()) -> None:
        await self._request("PATCH", pool, {"spec": {"replicas": replicas}})

    async def close(self) -> None:
        await self._client.aclose()

    async def _request(
        self, method: str, pool: Pool, body: dict[str, object] | None = None
    ) -> httpx.Response:
        headers = self._headers()
        if body is not None:
            headers["Content-Type"] = "application/merge-patch+json"
        path = self.target.scale_path(pool)
        try:
            response = await self._client.request(method, path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise ActuatorError(f"{method} {path}: {exc}") from exc
        if response.status_code >= 400:
            raise ActuatorError(f"{method} {path}: {response.status_code} {response.text[:200]}")
        return response
