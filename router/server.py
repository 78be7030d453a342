"""``pdserve router``: one uvloop process serving gRPC (RouterService) and OpenAI HTTP.

    pdserve router --model tiny-llama --port 8000 --grpc-port 50051 \\
        [--prefill 127.0.0.1:50061,... --decode 127.0.0.1:50071,...] [--api-key KEY]

Nodes started with ``--router HOST:GRPC_PORT`` register themselves; ``--prefill/--decode`` add
static instances that are polled instead. When both servers listen the process prints
``PDSERVE_READY http_port=NNNN grpc_port=NNNN`` on stdout. SIGINT/SIGTERM stop it gracefully:
no new requests, in-flight ones get a few seconds, background Aborts are flushed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import uvicorn
from fastapi import FastAPI
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.slo import LiveSLOStats
from common.models.names import resolve_model_path
from router.autoscale.config import AutoscaleSettings, add_autoscale_arguments
from router.autoscale.loop import start_autoscaler
from router.balancer import DECODE_POLICIES, PREFILL_POLICIES
from router.config import RouterConfig, add_arguments
from router.core import RouterCore, ServedModel
from router.flow import FlowConfig, RequestFlow
from router.grpc_api import RouterServicer, add_router_service
from router.http_api import create_app
from router.limits import Limits
from router.maintenance import poll_static, run_maintenance
from router.metrics import RouterMetrics
from router.node_clients import NodeClients, NodeTLS
from router.prompts import PromptProcessor, keep_torch_out
from router.registry import Registry, Role
from router.security import HttpGuard, server_credentials

logger = logging.getLogger(__name__)

_GRACE_S = 5.0


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``router`` subcommand."""
    parser = subparsers.add_parser("router", help="gRPC + OpenAI HTTP front door")
    add_arguments(parser)
    add_autoscale_arguments(parser)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    keep_torch_out()
    import uvloop

    try:
        config = RouterConfig.from_args(args)
        autoscale = AutoscaleSettings.from_args(args, config.slo)
    except ValueError as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    try:
        uvloop.run(serve(config, autoscale))
    except PortBusy as exc:
        raise SystemExit(f"pdserve router: {exc}") from None
    return 0


@dataclass
class Router:
    """Every long-lived part of a router, wired together (see :func:`build_router`)."""

    config: RouterConfig
    registry: Registry
    clients: NodeClients
    core: RouterCore
    http_app: FastAPI
    servicer: RouterServicer


def build_router(config: RouterConfig) -> Router:
    """Wire the components (loads the tokenizer; opens no socket)."""
    model_dir = resolve_model_path(config.model)
    # a served name replaces the model's (as vLLM: a request naming the path is a 404)
    aliases = (
        frozenset(config.served_model_aliases)
        if config.served_model_name
        else frozenset({config.model, str(model_dir)})
    )
    served = ServedModel(
        name=config.served_model_name or config.model, aliases=aliases, created=int(time.time())
    )
    prompts = PromptProcessor(resolve_model_path(config.tokenizer or config.model))
    _check_layout_flags(config, prompts.model_max_len)
    registry = Registry(
        config.model,
        heartbeat_interval_s=config.heartbeat_interval_s,
        heartbeat_timeout_s=config.heartbeat_timeout_s,
        suspect_cooldown_s=max(2 * config.heartbeat_interval_s, 1.0),
        model_aliases=served.aliases | {served.name},
        block_size=config.block_size,
        max_model_len=config.max_model_len,
        progress_timeout_s=config.progress_timeout_s,
    )
    for role, addresses in ((Role.PREFILL, config.prefill), (Role.DECODE, config.decode)):
        for address in addresses:
            registry.add_static(role, address)
    tls = NodeTLS.from_flags(
        config.node_tls_ca, config.node_tls_cert, config.node_tls_key, config.node_tls_server_name
    )
    clients = NodeClients(tls)
    slo = LiveSLOStats(config.slo, window_s=config.slo_window_s)
    metrics = RouterMetrics(
        registry.state_counts,
        slo,
        lambda: [(i.instance_id, i.load) for i in registry.instances(Role.DECODE)],
        model_name=served.name,
    )
    flow = RequestFlow(
        registry,
        clients,
        prompts.tokenizer,
        PREFILL_POLICIES[config.prefill_policy](),
        DECODE_POLICIES[config.decode_policy](),
        FlowConfig(
            config.max_retries,
            config.prefill_timeout_s,
            config.decode_stall_timeout_s,
            config.prefill_fallback,
            config.quarantine_after,
            progress_timeout_s=config.progress_timeout_s,
        ),
        on_fallback=metrics.prefill_fallback,
        eos_token_ids=prompts.eos_token_ids,
    )
    limits = Limits(
        max_n=config.max_n,
        max_logprobs=config.max_logprobs,
        max_prompt_tokens=config.max_prompt_tokens,
    )
    core = RouterCore(served, prompts, flow, metrics, limits, config.max_inflight)
    guard = HttpGuard(
        config.api_key, config.max_body_bytes, config.max_header_bytes, config.max_json_depth
    )
    return Router(
        config,
        registry,
        clients,
        core,
        create_app(core, registry, guard),
        RouterServicer(core, registry, config.api_key, config.node_key or config.api_key),
    )


def _check_layout_flags(config: RouterConfig, model_max_len: int) -> None:
    """The router learns block size and context length from its nodes; its own flags only
    check them (a node that disagrees is refused at registration)."""
    if config.block_size is not None:
        logger.warning(
            "--block-size is deprecated: the router takes the block size from its nodes;"
            " set to %d, it only refuses nodes with another block size",
            config.block_size,
        )
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(
            f"--max-model-len {config.max_model_len} exceeds the model's limit {model_max_len}"
        )


async def start_grpc(router: Router) -> tuple[grpc.aio.Server, int]:
    """Start the gRPC server (RouterService + health); returns it and its port."""
    config = router.config
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    add_router_service(router.servicer, server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{_bracket(config.host)}:{config.grpc_port}"
    try:
        if config.tls_cert and config.tls_key:
            creds = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
            port = server.add_secure_port(address, creds)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's "Failed to bind to address …"
        port = 0
    if port == 0:
        raise PortBusy(f"cannot listen on {address} for gRPC (--grpc-port changes the port)")
    await server.start()
    return server, port


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: ``serve()`` below owns the signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(router: Router) -> tuple[_UvicornServer, socket.socket]:
    """A uvicorn server for the HTTP app and its already-bound listening socket."""
    config = router.config
    sock = _bind(config.host, config.port)
    uv_config = uvicorn.Config(
        router.http_app,
        http="h11",
        # h11's own header limit stays above ours so our 431 (with a JSON body) answers first.
        h11_max_incomplete_event_size=max(4 * config.max_header_bytes, 64 * 2**10),
        lifespan="off",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=int(_GRACE_S),
        timeout_keep_alive=config.http_keep_alive_s,
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
    )
    return _UvicornServer(uv_config), sock


class PortBusy(OSError):
    """A port the router was told to listen on is taken (or not ours to bind)."""


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PortBusy(
            f"cannot listen on {_bracket(host)}:{port} for HTTP: {exc.strerror}"
            " (--port changes the port)"
        ) from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


async def serve(config: RouterConfig, autoscale: AutoscaleSettings | None = None) -> None:
    """Run the router (and its autoscaler, if given) until SIGINT/SIGTERM; then stop
    gracefully."""
    router = build_router(config)
    await poll_static(router.registry, router.clients, timeout_s=2.0)
    grpc_server, grpc_port = await start_grpc(router)
    try:
        uv_server, sock = http_server(router)
    except PortBusy:
        await grpc_server.stop(None)
        raise
    http_task = asyncio.create_task(uv_server.serve(sockets=[sock]))
    upkeep = asyncio.create_task(
        run_maintenance(router.registry, router.clients, config.poll_interval_s)
    )
    while not uv_server.started:
        if http_task.done():
            await grpc_server.stop(None)
            raise RuntimeError(f"the HTTP server did not start: {http_task.exception()!r}")
        await asyncio.sleep(0.01)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http_port = sock.getsockname()[1]
    print(f"PDSERVE_READY http_port={http_port} grpc_port={grpc_port}", flush=True)
    logger.info("router serving %s: HTTP %s:%d, gRPC %s:%d", router.core.served.name,
                config.host, http_port, config.host, grpc_port)  # fmt: skip
    scaler = None
    if autoscale is not None:
        from launcher.processes import connect_host  # the local actuator's nodes dial back

        router_grpc = f"{connect_host(config.host)}:{grpc_port}"
        scaler = await start_autoscaler(
            autoscale,
            router.registry,
            router.core.metrics,
            router_grpc,
            config.model,
            config.node_key or config.api_key,
            router.clients.tls,
        )
    await asyncio.wait([asyncio.create_task(stop.wait()), http_task],
                       return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    await shutdown(router, grpc_server, uv_server, http_task, upkeep)
    if scaler is not None:
        await scaler.stop()  # after the grace period: the local actuator's nodes drain, exit


async def shutdown(
    router: Router,
    grpc_server: grpc.aio.Server,
    uv_server: _UvicornServer,
    http_task: asyncio.Task[None],
    upkeep: asyncio.Task[None],
) -> None:
    """Stop accepting, let in-flight requests finish for a grace period, release everything."""
    logger.info("router stopping")
    uv_server.should_exit = True
    upkeep.cancel()
    await asyncio.gather(grpc_server.stop(_GRACE_S), http_task, upkeep, return_exceptions=True)
    await router.core.flow.drain_aborts()
    await router.clients.close()
