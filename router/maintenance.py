"""Background upkeep of the registry: expire silent instances, mark stalled ones (their streams
move elsewhere), poll static ones.

Static instances (``--prefill``/``--decode``) do not register, so the router asks them: once
``GetInfo`` for what they serve (the same checks as a registration: one that does not fit the
pool stays out of it, and the reason is logged), then, every round, ``GetLoad`` for their load
and the standard ``grpc.health.v1`` Check for their health. A failed poll marks the instance
unhealthy (balancers skip it) until a later poll succeeds.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import load_from_proto, node_info_from_proto
from pdserve_proto.nodes import NodeLoad

from router.node_clients import NodeClients
from router.registry import Instance, Registry, Role

logger = logging.getLogger(__name__)


async def poll_instance(
    registry: Registry, clients: NodeClients, instance: Instance, timeout_s: float
) -> NodeLoad | None:
    """The instance's load if it reports SERVING, fits the pool and answers GetLoad; None
    otherwise."""
    stub = (
        clients.decode(instance.address)
        if instance.role is Role.DECODE
        else clients.prefill(instance.address)
    )
    try:
        health = await clients.health(instance.address).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
        if health.status != health_pb2.HealthCheckResponse.SERVING:
            return None
        if instance.info is None:
            info = node_info_from_proto(await stub.GetInfo(pb.GetInfoRequest(), timeout=timeout_s))
            registry.describe_static(instance, info)
        report = await stub.GetLoad(pb.GetLoadRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError as exc:
        logger.debug("poll of %s failed: %s", instance.address, exc.code().name)
        return None
    except ValueError as exc:  # a malformed NodeInfo, or one the pool refuses
        if instance.healthy:
            logger.error("static instance %s left out of the pool: %s", instance.address, exc)
        return None
    return load_from_proto(report)


async def poll_static(registry: Registry, clients: NodeClients, timeout_s: float) -> None:
    """Poll every static instance once, concurrently, and record the results."""
    static = [i for i in registry.instances() if i.static]
    loads = await asyncio.gather(*(poll_instance(registry, clients, i, timeout_s) for i in static))
    for instance, load in zip(static, loads):
        if (load is None) != (not instance.healthy):
            logger.info(
                "static %s %s is %s",
                instance.role.value,
                instance.address,
                "healthy" if load is not None else "unhealthy",
            )
        registry.update_static(instance, load)


async def expire_silent(registry: Registry, clients: NodeClients) -> None:
    """Drop instances past their heartbeat timeout; close channels nobody uses any more."""
    for instance in registry.expire():
        logger.warning(
            "dropped %s instance %s at %s: no heartbeat for %.1f s",
            instance.role.value,
            instance.instance_id,
            instance.address,
            registry.heartbeat_timeout_s,
        )
        if instance.inflight == 0 and not registry.uses_address(instance.address):
            await clients.forget(instance.address)


def drop_refused(registry: Registry, clients: NodeClients) -> None:
    """Drop registered instances whose port refuses connections and that missed a heartbeat
    (a SIGKILLed node: `/ready` counted it, on and off as its calls failed, until its
    heartbeats lapsed after the whole timeout)."""
    for instance in registry.instances():
        if instance.static or not clients.refused(instance.address):
            continue
        if registry.drop_if_silent(instance):
            logger.warning(
                "dropped %s instance %s at %s: it refuses connections",
                instance.role.value,
                instance.instance_id,
                instance.address,
            )


def report_stalled(registry: Registry) -> None:
    """Mark the instances whose engine stopped making progress while holding requests (out of
    routing; the flows streaming from them move their requests, ``router.flow``)."""
    for instance, stalled_s in registry.mark_stalled():
        logger.warning(
            "%s instance %s at %s is stalled: no engine progress for %.1f s while it held"
            " requests (%d reported, %d of this router's); out of routing, its requests move"
            " elsewhere",
            instance.role.value,
            instance.instance_id,
            instance.address,
            stalled_s,
            instance.load.num_requests,
            instance.inflight,
        )


async def run_maintenance(registry: Registry, clients: NodeClients, interval_s: float) -> None:
    """Forever: expire, mark stalled, then poll, every ``interval_s`` seconds (cancel to
    stop)."""
    while True:
        try:
            await expire_silent(registry, clients)
            drop_refused(registry, clients)
            report_stalled(registry)
            await poll_static(registry, clients, timeout_s=max(interval_s, 1.0))
        except Exception:  # keep the loop alive: one bad round must not stop upkeep
            logger.exception("registry maintenance failed")
        await asyncio.sleep(interval_s)
