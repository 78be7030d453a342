"""The node watchdog: a node that is alive but stuck is killed, so supervision replaces it.

NOTE. Supervision (``launcher.supervisor``) restarts what *exits*; a node frozen by SIGSTOP, or
one whose engine core is wedged (a step blocked in a syscall on a stalled filesystem, a lock a
stuck I/O thread holds), never exits. So the local actuator asks each serving node for its load
every ``interval_s`` (``GetLoad``: the report its heartbeats carry) and judges it with the
router's rule (``pdserve_proto.progress``): a node that holds requests while its engine loop
has not turned for ``timeout_s``, or that has not answered for ``timeout_s`` (a frozen
frontend), is hung. The actuator then SIGKILLs its process group; the kill is an exit like any other, replaced
after the backoff, with "hung: …" as its cause, so its restart budget is its own
(``RestartBudgets``). Meanwhile the router has moved the node's requests at its own
``--progress-timeout``, shorter by default: the watchdog replaces capacity, it rescues no
request. ``timeout_s`` must outlast the longest engine step (a node answers its load between
steps, and a long step looks like a stuck one).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import load_from_proto
from pdserve_proto.nodes import NodeLoad
from pdserve_proto.progress import ProgressWatch

from router.autoscale.policy import Pool
from router.node_clients import NodeClients, NodeTLS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WatchdogConfig:
    """``timeout_s``: how long a node may hold requests with a standing engine, or not answer,
    before it is killed (0: no watchdog); ``interval_s``: how often each node is asked."""

    timeout_s: float = 30.0
    interval_s: float = 1.0
    rpc_timeout_s: float = 3.0
    tls: NodeTLS | None = None  # nodes serving TLS: reached as the router reaches them

    def __post_init__(self) -> None:
        if self.timeout_s < 0 or self.interval_s <= 0 or self.rpc_timeout_s <= 0:
            raise ValueError("need timeout_s >= 0 (0: off), interval_s > 0 and rpc_timeout_s > 0")

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0


class NodeWatch:
    """What the watchdog knows of one node: its progress and when it last answered."""

    def __init__(self, timeout_s: float, now_s: float) -> None:
        self.timeout_s = timeout_s
        self.progress = ProgressWatch(timeout_s, now_s)
        self.answered_s = now_s

    def verdict(self, load: NodeLoad | None, now_s: float) -> str | None:
        """Take the answer to one probe (None: none came); why the node is hung, or None."""
        if load is None:
            silent = now_s - self.answered_s
            return f"hung: no answer for {silent:.0f} s" if silent >= self.timeout_s else None
        self.answered_s = now_s
        self.progress.observe(load, now_s)
        if not self.progress.stalled(now_s):
            return None
        stalled = self.progress.stalled_for(now_s)
        return (
            f"hung: its engine made no progress for {stalled:.0f} s while it held"
            f" {load.num_requests} requests"
        )


class LoadProbe:
    """``GetLoad`` of nodes by address, over one channel per node (:meth:`forget` drops it)."""

    def __init__(self, rpc_timeout_s: float, tls: NodeTLS | None = None) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self._clients = NodeClients(tls)

    async def __call__(self, pool: Pool, address: str) -> NodeLoad | None:
        """The node's load, or None when it did not answer in time."""
        channel = self._clients.channel(address)
        stub: pb_grpc.PrefillServiceStub | pb_grpc.DecodeServiceStub = (
            pb_grpc.PrefillServiceStub(channel)
            if pool is Pool.PREFILL
            else pb_grpc.DecodeServiceStub(channel)
        )
        try:
            report = await stub.GetLoad(pb.GetLoadRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            logger.debug("load probe of %s failed: %s", address, exc.code().name)
            return None
        return load_from_proto(report)

    async def forget(self, keep: set[str]) -> None:
        """Close the channels of addresses not in ``keep``."""
        for address in self._clients.addresses():
            if address not in keep:
                await self._clients.forget(address)

    async def close(self) -> None:
        await self._clients.close()


async def probe_all(probe: LoadProbe, targets: list[tuple[Pool, str]]) -> list[NodeLoad | None]:
    """Probe every (pool, address) at once."""
    return list(await asyncio.gather(*(probe(pool, address) for pool, address in targets)))
