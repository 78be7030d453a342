"""State shared by a node's RPC handlers: the engine-core client, admission, drain, health, stats.

Admission: a request is refused with UNAVAILABLE while the node is starting or draining, and
with RESOURCE_EXHAUSTED when ``max_queue`` requests already wait beyond the ``max_num_seqs`` the
engine runs at once. Every admitted request is counted until its handler returns, which is what
draining waits for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import (
    load_to_proto,
    node_info_from_engine,
    node_info_to_proto,
    node_load_from_engine,
)
from pdserve_proto.nodes import NodeInfo, NodeLoad

from common.config import LoraConfig
from common.core_client import CoreClient, CoreRequestError
from common.core_messages import Ready
from common.lora.adapter import LoraRef, read_adapter
from node_frontend.options import NodeOptions
from node_frontend.stats import NodeStats

logger = logging.getLogger(__name__)

LOAD_WAIT_S = 1.0  # longest wait for the engine core's load (a heartbeat is never later)

_STATUS_CODES = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "already_exists": grpc.StatusCode.ALREADY_EXISTS,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    # the request failed inside the engine, which goes on: the router does not retry it
    "request_failed": grpc.StatusCode.ABORTED,
}


async def abort_with(context: grpc.aio.ServicerContext, error: CoreRequestError) -> NoReturn:
    """End the call with the gRPC status that matches a core refusal."""
    code = _STATUS_CODES.get(error.code, grpc.StatusCode.INTERNAL)
    await context.abort(code, error.message)
    raise AssertionError("unreachable")  # context.abort raises


async def invalid_argument(context: grpc.aio.ServicerContext, message: str) -> NoReturn:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
    raise AssertionError("unreachable")


class NodeRuntime:
    """One node's frontend state. ``core`` is started by :meth:`start`, stopped by
    :meth:`shutdown`; handlers wrap their work in :meth:`admit`."""

    def __init__(
        self, role: pb.Role.ValueType, service_name: str, options: NodeOptions, core: CoreClient
    ) -> None:
        self.role = role
        self.service_name = service_name
        self.options = options
        self.core = core
        self.stats = NodeStats()
        self.health = health.aio.HealthServicer()
        self.draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._core_silent = False  # the last load query went unanswered (logged once)
        # LoRA adapters served, by name (--lora-modules, then LoadLoraAdapter/Unload…)
        self.adapters: dict[str, LoraRef] = dict(options.lora_adapters)

    @property
    def info(self) -> Ready:
        assert self.core.info is not None, "the engine core is not started"
        return self.core.info

    @property
    def in_flight(self) -> int:
        return self._in_flight

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> Ready:
        """Start the engine core, then report SERVING."""
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        info = await self.core.start()
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return info

    async def _set_health(self, status: health_pb2.HealthCheckResponse.ServingStatus.ValueType):
        for name in ("", self.service_name):
            await self.health.set(name, status)

    async def start_draining(self) -> None:
        """NOT_SERVING from now on; new requests get UNAVAILABLE."""
        self.draining = True
        await self.health.enter_graceful_shutdown()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no admitted request is left; False if ``timeout_s`` ran out first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    async def shutdown(self) -> None:
        await self.core.shutdown()

    # -- admission ---------------------------------------------------------------------------
    @asynccontextmanager
    async def admit(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Count a request in for the duration of the ``async with`` block, or end the call
        with UNAVAILABLE (starting, draining) / RESOURCE_EXHAUSTED (over ``max_queue``)."""
        if self.draining or not self.core.alive:
            reason = "draining" if self.draining else "not ready"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"node is {reason}")
        if self._in_flight - self.info.max_num_seqs >= self.options.max_queue:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"node queue is full ({self._in_flight} requests in flight)",
            )
        self._in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    # -- shared RPCs -------------------------------------------------------------------------
    @property
    def node_info(self) -> NodeInfo:
        """What this node serves (model, KV layout), from its engine's ``Ready``."""
        return node_info_from_engine(self.info)

    async def load(self) -> NodeLoad:
        """Engine load plus this node's recent latencies, rates and held requests; never raises.

        Waits at most ``LOAD_WAIT_S`` for the engine core (it answers between steps): one that
        does not answer in time — in a long step, or stuck — is reported by its last answer,
        so a heartbeat is never late and a stuck core's ``engine_steps`` stand still. A dead
        core reports zeros."""
        if self.core.alive:
            try:
                await self.core.get_load(timeout_s=LOAD_WAIT_S)
                self._core_silent = False
            except (RuntimeError, asyncio.TimeoutError) as e:
                if not self._core_silent:
                    logger.warning("engine core did not report its load: %r", e)
                self._core_silent = True
        stats = self.core.last_load if self.core.alive else None
        max_num_seqs = self.core.info.max_num_seqs if self.core.info is not None else 0
        load = node_load_from_engine(stats, max_num_seqs, self.draining, self._in_flight)
        load = dataclasses.replace(load, lora_adapters=tuple(sorted(self.adapters)))
        return self.stats.with_latencies(load)

    def adapter(self, name: str) -> LoraRef | None:
        """The adapter a request names (empty: the base model); ValueError if not served."""
        if not name:
            return None
        lora = self.adapters.get(name)
        if lora is None:
            served = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not served here (served: {served})")
        return lora

    def load_adapter(self, name: str, path: str) -> None:
        """Serve ``path`` as ``name`` (checked: readable, rank, LoRA on). Loading the same files
        under the same name again is a no-op; other files under a name in use are refused
        (unload it first: requests running under the old weights keep their KV apart)."""
        if not self.options.enable_lora:
            raise ValueError("LoRA is not enabled on this node (--enable-lora)")
        rank = self.options.max_lora_rank or LoraConfig.max_lora_rank
        lora, _ = read_adapter(name, path, rank)
        known = self.adapters.get(name)
        if known is not None and known.content_hash != lora.content_hash:
            raise ValueError(f"LoRA adapter {name!r} is already served with other weights")
        self.adapters[name] = lora
        logger.info("serving LoRA adapter %s from %s", lora.identity, lora.path)

    async def load_report(self) -> pb.LoadReport:
        return load_to_proto(self.role, await self.load())


class NodeRpcs:
    """``Abort``, ``GetLoad`` and ``GetInfo``, the same on every node kind (mix in before the
    generated servicer base class)."""

    runtime: NodeRuntime

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        if not request.request_id:
            await invalid_argument(context, "request_id is required")
        return pb.AbortResponse(found=self.runtime.core.abort(request.request_id))

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadReport:
        return await self.runtime.load_report()

    async def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.NodeInfo:
        if self.runtime.core.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "node is not ready")
        return node_info_to_proto(self.runtime.node_info)

    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        try:  # reading and hashing its files: off the event loop
            await asyncio.to_thread(self.runtime.load_adapter, request.name, request.path)
        except ValueError as e:
            await invalid_argument(context, str(e))
        return pb.LoraAdapterResponse(lora_adapters=sorted(self.runtime.adapters))

    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoraAdapterResponse:
        if self.runtime.adapters.pop(request.name, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter {request.name!r}")
        return pb.LoraAdapterResponse(lora_adapters=sorted(self.runtime.adapters))
