"""An in-process router wired to fake nodes, for flow tests without engines or subprocesses.

Use inside ``asyncio.run``: every gRPC object is bound to the running loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import httpx

from router.config import RouterConfig
from router.registry import Role
from router.server import Router, build_router, http_server, start_grpc
from tests.router.fakes import INFO, FakeNode, Script, start_fake


@dataclass
class Harness:
    router: Router
    prefill: list[FakeNode]
    decode: list[FakeNode]
    http: httpx.AsyncClient
    grpc_server: grpc.aio.Server | None = None
    grpc_port: int = 0

    def scripts(self, role: str) -> list[Script]:
        return [n.script for n in (self.prefill if role == "prefill" else self.decode)]


@asynccontextmanager
async def running_router(
    num_prefill: int = 2,
    num_decode: int = 2,
    grpc_server: bool = False,
    node_tls: grpc.ServerCredentials | None = None,
    **config: Any,
) -> AsyncIterator[Harness]:
    """A router (HTTP through ASGI, optionally a real gRPC port) with registered fakes
    (serving TLS with ``node_tls``)."""
    prefill = [await start_fake("prefill", tls=node_tls) for _ in range(num_prefill)]
    decode = [await start_fake("decode", tls=node_tls) for _ in range(num_decode)]
    router = build_router(RouterConfig(port=0, grpc_port=0, **config))
    for i, node in enumerate(prefill):
        router.registry.register(f"prefill-{i}", Role.PREFILL, node.address, INFO)
    for i, node in enumerate(decode):
        router.registry.register(f"decode-{i}", Role.DECODE, node.address, INFO)
    headers = {"Authorization": f"Bearer {config['api_key']}"} if config.get("api_key") else {}
    transport = httpx.ASGITransport(app=router.http_app)
    http = httpx.AsyncClient(transport=transport, base_url="http://router", headers=headers)
    harness = Harness(router, prefill, decode, http)
    if grpc_server:
        harness.grpc_server, harness.grpc_port = await start_grpc(router)
    try:
        yield harness
    finally:
        await http.aclose()
        if harness.grpc_server is not None:
            await harness.grpc_server.stop(None)
        await router.core.flow.drain_aborts()
        await router.clients.close()
        for node in prefill + decode:
            await node.stop()


@asynccontextmanager
async def serving_http(router: Router) -> AsyncIterator[str]:
    """``router``'s HTTP app on real uvicorn (h11, as ``pdserve router`` runs it) on a free
    loopback port; yields its base URL. For what ASGI transports do not show: connections
    closed by the client, bodies the server does not read."""
    server, sock = http_server(router)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            raise RuntimeError(f"uvicorn did not start: {task.exception()!r}")
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        await task
