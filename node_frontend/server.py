"""Run a node: grpc.aio server on uvloop + engine-core process + router registration.

Life of a node process (``serve``):

1. bind the gRPC server (health NOT_SERVING), start the engine core and wait for it;
2. health SERVING; print ``PDSERVE_READY port=N`` on stdout; register with the router if asked;
3. on SIGTERM/SIGINT: deregister, health NOT_SERVING, refuse new work (UNAVAILABLE), let
   in-flight requests finish for up to ``--drain-timeout`` seconds (a second signal cuts this
   short), stop the server (cancelling what is left: their requests are aborted in the core),
   shut the core down and return 0. If the engine core dies, the same steps run at once (its
   requests have already failed) and the exit status is 1, so a supervisor restarts the node.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import uvloop
from grpc_health.v1 import health_pb2_grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import node_info_to_proto

from common.core_client import CoreClient
from node_frontend.options import NodeOptions, add_node_arguments, options_from_args
from node_frontend.registration import RouterRegistration, tls_credentials
from node_frontend.runtime import NodeRuntime

logger = logging.getLogger(__name__)

READY_LINE = "PDSERVE_READY port={port}"
_STOP_GRACE_S = 2.0


@dataclass(frozen=True)
class NodeKind:
    """What differs between node kinds: the role, the engine's KV role and the service."""

    role: pb.Role.ValueType
    kv_role: str  # producer / consumer / both (common.config.EngineConfig.kv_role)
    service_name: str  # full gRPC service name, e.g. "pdserve.v1.PrefillService"
    make_servicer: Callable[[NodeRuntime], Any]
    add_servicer: Callable[[Any, grpc.aio.Server], None]


class _Signals:
    """SIGTERM/SIGINT as events: the first asks to stop, the second to stop now."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.force = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        logger.info("received %s", signal.Signals(sig).name)
        (self.force if self.stop.is_set() else self.stop).set()


def store_connector(*args):  # type: ignore[no-untyped-def]
    """The engine's KV connector (``kv_transfer.connector.create_store_connector``), imported in
    the engine-core process only: the frontend stays free of torch."""
    from kv_transfer.connector import create_store_connector

    return create_store_connector(*args)


async def serve(options: NodeOptions, kind: NodeKind) -> int:
    """Run the node until SIGTERM/SIGINT; returns the process exit status."""
    signals = _Signals()
    core = CoreClient(
        options.engine_config(kind.kv_role),
        connector_factory=store_connector,  # the node wires the store into its engine
        startup_timeout_s=options.startup_timeout,
    )
    runtime = NodeRuntime(kind.role, kind.service_name, options, core)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])  # a busy port is an error
    kind.add_servicer(kind.make_servicer(runtime), server)
    health_pb2_grpc.add_HealthServicer_to_server(runtime.health, server)
    try:
        address, credentials = f"{options.host}:{options.port}", options.server_credentials()
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
        await server.start()
        if not await _start_core(runtime, signals):
            await server.stop(None)
            return 0
    except RuntimeError as e:
        if str(e).startswith("Failed to bind"):  # grpc's words: name the flag instead
            e = RuntimeError(f"cannot listen on {options.host}:{options.port} (--port changes it)")
        logger.error("node failed to start: %s", e)
        await server.stop(None)
        await runtime.shutdown()
        return 1
    print(READY_LINE.format(port=port), flush=True)
    logger.info("%s node serving on %s:%d", pb.Role.Name(kind.role), options.host, port)
    registration = _registration(options, kind, runtime, port)
    failure = await _until_stopped(signals, core)
    if failure is not None:
        logger.error("stopping the node: %s", failure)
    await _drain(runtime, registration, signals)
    await server.stop(_STOP_GRACE_S)
    await runtime.shutdown()
    logger.info("node stopped")
    return 0 if failure is None else 1


async def _until_stopped(signals: _Signals, core: CoreClient) -> str | None:
    """Wait for a stop signal (returns None) or the engine core's death (returns why)."""
    stop = asyncio.create_task(signals.stop.wait())
    failed = asyncio.create_task(core.wait_failed())
    await asyncio.wait({stop, failed}, return_when=asyncio.FIRST_COMPLETED)
    reason = failed.result() if failed.done() else None
    stop.cancel()
    failed.cancel()
    return reason


async def _start_core(runtime: NodeRuntime, signals: _Signals) -> bool:
    """Start the engine core; False if a stop signal came first (the core is shut down)."""
    start = asyncio.create_task(runtime.start())
    stop = asyncio.create_task(signals.stop.wait())
    await asyncio.wait({start, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if start.done():
        start.result()  # raises RuntimeError if the core failed
        return True
    start.cancel()
    await asyncio.gather(start, return_exceptions=True)
    await runtime.shutdown()
    return False


def _registration(
    options: NodeOptions, kind: NodeKind, runtime: NodeRuntime, port: int
) -> RouterRegistration | None:
    if options.router is None:
        return None
    request = pb.RegisterRequest(
        instance_id=f"{pb.Role.Name(kind.role).lower()}-{socket.gethostname()}-{os.getpid()}"
        f"-{uuid.uuid4().hex[:8]}",
        role=kind.role,
        address=options.address(port),
        info=node_info_to_proto(runtime.node_info),
    )
    credentials = None
    if options.router_tls_ca is not None:
        credentials = tls_credentials(
            options.router_tls_ca, options.router_tls_cert, options.router_tls_key
        )
    registration = RouterRegistration(
        options.router,
        request,
        runtime.load_report,
        credentials=credentials,
        node_key=options.node_key,
        advertise=lambda: options.address(port),
    )
    registration.start()
    return registration


async def _drain(
    runtime: NodeRuntime, registration: RouterRegistration | None, signals: _Signals
) -> None:
    """Stop taking work and wait (bounded) for what is in flight."""
    await runtime.start_draining()
    if registration is not None:
        await registration.stop()
    timeout_s = runtime.options.drain_timeout
    logger.info("draining %d requests (up to %.0f s)", runtime.in_flight, timeout_s)
    idle = asyncio.create_task(runtime.wait_idle(timeout_s))
    force = asyncio.create_task(signals.force.wait())
    await asyncio.wait({idle, force}, return_when=asyncio.FIRST_COMPLETED)
    force.cancel()
    if not (idle.done() and idle.result()):
        idle.cancel()
        logger.warning("drain ended with %d requests still in flight", runtime.in_flight)


def run_node(options: NodeOptions, kind: NodeKind) -> int:
    """Blocking entry point of ``pdserve prefill`` / ``pdserve decode``."""
    return uvloop.run(serve(options, kind))


def add_node_command(
    subparsers: argparse._SubParsersAction, name: str, help: str, default_port: int, kind: NodeKind
) -> None:
    """Register ``pdserve <name>``: the node flags, then ``run_node`` with ``kind``."""
    parser = subparsers.add_parser(name, help=help)
    add_node_arguments(parser, default_port)

    def main(args: argparse.Namespace) -> int:
        try:
            options = options_from_args(args, default_port)
        except ValueError as e:
            raise SystemExit(f"pdserve {name}: {e}") from None
        return run_node(options, kind)

    parser.set_defaults(func=main)
