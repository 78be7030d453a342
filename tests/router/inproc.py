"""An in-process router wired to fake nodes, for flow tests without engines or subprocesses.

Use inside ``asyncio.run``: every gRPC object is bound to the running loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import httpx

from router.config import RouterConfig
from router.registry import Role
from router.server import Router, build_router, start_grpc
from tests.router.fakes import FakeNode, Script, start_fake


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
        router.registry.register(f"prefill-{i}", Role.PREFILL, node.address)
    for i, node in enumerate(decode):
        router.registry.register(f"decode-{i}", Role.DECODE, node.address)
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
