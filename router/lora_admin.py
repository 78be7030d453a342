"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``: the change made on every node.

The router keeps no adapter table of its own: each node reports the adapters it serves in its
load (``LoadReport.lora_adapters``), and a request for an adapter goes only to nodes that list
it (``Registry.candidates``). Loading calls every registered node at once and records each
answer in its load at once, so the adapter is routable before the next heartbeat. A node that
registers later serves its own ``--lora-modules`` only; the router never sends it a request for
an adapter it does not list, so a missing adapter costs capacity, never correctness.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from router.errors import RouterError, invalid_request, no_instance
from router.node_clients import NodeClients
from router.registry import Instance, Registry, Role

logger = logging.getLogger(__name__)

_T = 30.0  # seconds for a node to read and hash an adapter's files
Stub = pb_grpc.PrefillServiceStub | pb_grpc.DecodeServiceStub
_Call = Callable[[Stub], Awaitable[pb.LoraAdapterResponse]]


async def load_lora_adapter(registry: Registry, clients: NodeClients, name: str, path: str) -> None:
    """Serve ``path`` as ``name`` on every node; 400 with the node's reason when a node
    refuses it (a bad directory, a rank over its limit, LoRA off, the name taken), and then no
    node keeps it (those that took it unload it again)."""
    if not name or not path:
        raise invalid_request("lora_name and lora_path are required", "lora_name")
    request = pb.LoadLoraAdapterRequest(name=name, path=path)
    had = {i.instance_id for i in registry.instances() if name in i.load.lora_adapters}
    try:
        await _on_every_node(registry, clients, lambda s: s.LoadLoraAdapter(request, timeout=_T))
    except RouterError:  # all or nothing: the nodes that took it give it back
        undo = pb.UnloadLoraAdapterRequest(name=name)
        took = [
            i
            for i in registry.instances()
            if name in i.load.lora_adapters and i.instance_id not in had
        ]
        await asyncio.gather(
            *(_stub(clients, i).UnloadLoraAdapter(undo, timeout=_T) for i in took),
            return_exceptions=True,
        )
        for instance in took:
            kept = tuple(a for a in instance.load.lora_adapters if a != name)
            instance.load = dataclasses.replace(instance.load, lora_adapters=kept)
        raise


async def unload_lora_adapter(registry: Registry, clients: NodeClients, name: str) -> None:
    """Stop serving ``name`` everywhere; 404 when no node served it."""
    if name not in registry.lora_adapters():
        raise RouterError(f"no LoRA adapter {name!r} is served", status=404,
                          param="lora_name", code="lora_adapter_not_found")  # fmt: skip
    request = pb.UnloadLoraAdapterRequest(name=name)
    call: _Call = lambda s: s.UnloadLoraAdapter(request, timeout=_T)  # noqa: E731
    await _on_every_node(registry, clients, call, missing_ok=True)


async def _on_every_node(
    registry: Registry, clients: NodeClients, call: _Call, missing_ok: bool = False
) -> None:
    instances = registry.instances()
    if not instances:
        raise no_instance("no node has registered yet")
    results = await asyncio.gather(
        *(call(_stub(clients, i)) for i in instances), return_exceptions=True
    )
    refusals: list[str] = []
    for instance, result in zip(instances, results):
        if isinstance(result, pb.LoraAdapterResponse):
            adapters = tuple(result.lora_adapters)
            instance.load = dataclasses.replace(instance.load, lora_adapters=adapters)
        elif isinstance(result, grpc.aio.AioRpcError) and result.code() in (
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.NOT_FOUND,
        ):
            if not (missing_ok and result.code() == grpc.StatusCode.NOT_FOUND):
                refusals.append(f"{instance.address}: {result.details()}")
        else:  # unreachable now: it keeps what it reports, and is routed by that
            logger.warning("LoRA adapter change on %s failed: %r", instance.address, result)
    if refusals:
        raise invalid_request("; ".join(refusals), "lora_path")


def _stub(clients: NodeClients, instance: Instance) -> Stub:
    """The node's service stub (a colocated node answers on both: its decode one)."""
    if instance.role.serves(Role.DECODE):
        return clients.decode(instance.address)
    return clients.prefill(instance.address)
