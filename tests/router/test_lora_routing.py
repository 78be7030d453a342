"""The router's side of LoRA: only nodes listing an adapter get its requests, the adapters
the pool serves are what ``model`` may name, and prefix affinity never pairs an adapter's
prompt with the base model's cache."""

from __future__ import annotations

from pdserve_proto.nodes import NodeLoad

from router.registry import Role
from tests.router.test_registry import INFO, Clock, make


def _pool():
    registry = make(Clock())
    registry.register("p0", Role.PREFILL, "h:1", INFO)
    registry.register("p1", Role.PREFILL, "h:2", INFO)
    registry.register("d0", Role.DECODE, "h:3", INFO)
    registry.heartbeat("p0", NodeLoad(lora_adapters=("alpha",)))
    registry.heartbeat("p1", NodeLoad(lora_adapters=("alpha", "beta")))
    registry.heartbeat("d0", NodeLoad(lora_adapters=("beta",)))
    return registry


def test_only_nodes_serving_the_adapter_are_candidates() -> None:
    registry = _pool()
    ids = lambda role, lora: [i.instance_id for i in registry.candidates(role, lora=lora)]  # noqa: E731
    assert ids(Role.PREFILL, "") == ["p0", "p1"]
    assert ids(Role.PREFILL, "alpha") == ["p0", "p1"]
    assert ids(Role.PREFILL, "beta") == ["p1"]
    assert ids(Role.DECODE, "alpha") == []  # no decode node has it: no path, never base weights
    assert ids(Role.DECODE, "beta") == ["d0"]
    assert registry.lora_adapters() == {"alpha", "beta"}


def test_affinity_hashes_are_salted_by_the_adapter() -> None:
    from router.flow import RequestFlow

    class _Flow:
        registry = _pool()

    prompt = list(range(3, 60))
    base = RequestFlow.prompt_info(_Flow(), prompt)  # type: ignore[arg-type]
    alpha = RequestFlow.prompt_info(_Flow(), prompt, "alpha")  # type: ignore[arg-type]
    beta = RequestFlow.prompt_info(_Flow(), prompt, "beta")  # type: ignore[arg-type]
    assert len(base.block_hashes) == 3
    assert not set(base.block_hashes) & set(alpha.block_hashes)
    assert not set(alpha.block_hashes) & set(beta.block_hashes)


class _Stub:
    """A node's LoRA RPCs: it takes an adapter, or refuses it as a node without LoRA would."""

    def __init__(self, takes: bool) -> None:
        self.takes, self.unloaded = takes, []

    async def LoadLoraAdapter(self, request, timeout):
        import grpc
        from pdserve_proto import pdserve_pb2 as pb

        if not self.takes:
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                details="LoRA is not enabled on this node (--enable-lora)",
            )  # fmt: skip
        return pb.LoraAdapterResponse(lora_adapters=[request.name])

    async def UnloadLoraAdapter(self, request, timeout):
        from pdserve_proto import pdserve_pb2 as pb

        self.unloaded.append(request.name)
        return pb.LoraAdapterResponse()


def test_a_load_one_node_refuses_is_undone_on_the_others() -> None:
    import asyncio

    import pytest

    from router.errors import RouterError
    from router.lora_admin import load_lora_adapter

    registry = make(Clock())
    stubs = {"h:1": _Stub(True), "h:2": _Stub(False), "h:3": _Stub(True)}
    for i, (address, role) in enumerate(zip(stubs, (Role.PREFILL, Role.PREFILL, Role.DECODE))):
        registry.register(f"n{i}", role, address, INFO)

    class Clients:
        def prefill(self, address):
            return stubs[address]

        decode = prefill

    with pytest.raises(RouterError, match="h:2: LoRA is not enabled"):
        asyncio.run(load_lora_adapter(registry, Clients(), "gamma", "/somewhere"))  # type: ignore[arg-type]
    assert stubs["h:1"].unloaded == ["gamma"] and stubs["h:3"].unloaded == ["gamma"]
    assert registry.lora_adapters() == set()  # no node keeps it, so none is routed to
