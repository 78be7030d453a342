"""Keeps a node registered with a router: Register, then Heartbeat with a LoadReport.

The RegisterRequest carries the node's ``NodeInfo`` (model, KV fingerprint, block size,
max_model_len), from which the router learns its layout. The loop never gives up: while the
router is down, or refuses the node (it cannot pool it with the nodes it has), it retries
(backing off to ``max_retry_s``); a Heartbeat answered ``known=false`` (the router dropped or
forgot us) registers again. :meth:`RouterRegistration.stop` ends the loop and sends Deregister.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

LoadFn = Callable[[], Awaitable[pb.LoadReport]]


def tls_credentials(
    ca: str, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """Credentials for a router whose gRPC port serves TLS: its CA, plus this node's
    certificate and key when the router asks for mutual TLS."""
    if (cert is None) != (key is None):
        raise ValueError("--router-tls-cert and --router-tls-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )


class RouterRegistration:
    """Registration of one node instance (``instance_id``) with the router at ``router``."""

    def __init__(
        self,
        router: str,
        request: pb.RegisterRequest,
        load: LoadFn,
        *,
        rpc_timeout_s: float = 5.0,
        max_retry_s: float = 5.0,
        credentials: grpc.ChannelCredentials | None = None,
        node_key: str | None = None,
        advertise: Callable[[], str] | None = None,
    ) -> None:
        """``advertise``: this node's address, asked again before every Register (a container
        reconnected to a network may have a new one); None keeps ``request.address``."""
        self.router = router
        self.request = request
        self._advertise = advertise
        self.load = load
        self.rpc_timeout_s = rpc_timeout_s
        self.max_retry_s = max_retry_s
        self.interval_s = 5.0  # replaced by the router's heartbeat_interval_s
        self.registered = False
        self._metadata = (("authorization", f"Bearer {node_key}"),) if node_key else ()
        self._channel = (
            grpc.aio.insecure_channel(router)
            if credentials is None
            else grpc.aio.secure_channel(router, credentials)
        )
        self._stub = pb_grpc.RouterServiceStub(self._channel)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-registration")

    async def stop(self) -> None:
        """Stop heartbeats and Deregister (best effort: the router may be gone)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        try:
            request = pb.DeregisterRequest(instance_id=self.request.instance_id)
            await self._stub.Deregister(
                request, timeout=self.rpc_timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as e:
            logger.info("deregister from %s failed: %s", self.router, e.code().name)
        await self._channel.close()

    async def _run(self) -> None:
        retry_s = 0.2
        while True:
            try:
                await self._beat()
                retry_s = 0.2
                await asyncio.sleep(self.interval_s)
            except grpc.aio.AioRpcError as e:
                self._log_failure(e, first=self.registered or retry_s == 0.2)
                self.registered = False
                await asyncio.sleep(retry_s)
                retry_s = min(retry_s * 2, self.max_retry_s)

    def _log_failure(self, error: grpc.aio.AioRpcError, first: bool) -> None:
        """A refusal (this node cannot join the router's pool: another model or KV layout) is
        an error worth its reason every time; an unreachable router, a warning once."""
        refusals = (
            grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.UNAUTHENTICATED,  # --node-key missing or not the router's
        )
        if error.code() in refusals:
            logger.error("router %s refused this node: %s", self.router, error.details())
        elif first:
            logger.warning("router %s unreachable (%s): retrying", self.router, error.code().name)

    async def _beat(self) -> None:
        """Register if needed, else Heartbeat (registering again when the router forgot us)."""
        load = await self.load()
        if self.registered:
            heartbeat = pb.HeartbeatRequest(instance_id=self.request.instance_id, load=load)
            reply = await self._stub.Heartbeat(
                heartbeat, timeout=self.rpc_timeout_s, metadata=self._metadata
            )
            if reply.known:
                return
            logger.info("router %s does not know this node: registering again", self.router)
        if self._advertise is not None:
            self.request.address = self._advertise()
        request = pb.RegisterRequest()
        request.CopyFrom(self.request)
        request.load.CopyFrom(load)
        response = await self._stub.Register(
            request, timeout=self.rpc_timeout_s, metadata=self._metadata
        )
        if response.heartbeat_interval_s > 0:
            self.interval_s = response.heartbeat_interval_s
        self.registered = True
        logger.info("registered with router %s as %s", self.router, self.request.instance_id)
