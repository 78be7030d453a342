"""Registration behind a key: with ``--api-key`` (or ``--node-key``) Register, Heartbeat and
Deregister need it; a rogue Register is refused and never learns the pool's fingerprint.

Real gRPC over loopback: the router's servicer on a real port, the node's own
``RouterRegistration`` client (the code a node runs) on the other end.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import node_info_to_proto

from node_frontend.registration import RouterRegistration
from tests.router.fakes import FINGERPRINT, INFO
from tests.router.inproc import Harness
from tests.router.test_grpc_api import run


def rogue(fingerprint: str = "bogus") -> pb.RegisterRequest:
    info = dataclasses.replace(INFO, fingerprint=fingerprint)
    return pb.RegisterRequest(
        instance_id="rogue", role=pb.ROLE_DECODE, address="127.0.0.1:9",
        info=node_info_to_proto(info),
    )  # fmt: skip


async def _load() -> pb.LoadReport:
    return pb.LoadReport()


@pytest.mark.parametrize("keys", [{"api_key": "k3y"}, {"api_key": "c1ient", "node_key": "k3y"}])
def test_registry_calls_need_the_node_key(keys: dict[str, str]) -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            calls = [
                lambda md: stub.Register(rogue(FINGERPRINT), metadata=md),
                lambda md: stub.Heartbeat(pb.HeartbeatRequest(instance_id="decode-0"), metadata=md),
                lambda md: stub.Deregister(
                    pb.DeregisterRequest(instance_id="decode-0"), metadata=md
                ),
            ]
            wrong = [(), (("authorization", "Bearer nope"),)]
            if "node_key" in keys:  # the client key is not the node key
                wrong.append((("authorization", f"Bearer {keys['api_key']}"),))
            for call in calls:
                for metadata in wrong:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(metadata)
                    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert h.router.registry.get("rogue") is None
            assert h.router.registry.get("decode-0") is not None  # not deregistered
            good = (("authorization", "Bearer k3y"),)
            assert (await calls[1](good)).known

    run(test, **keys)


def test_a_refused_fingerprint_is_never_revealed() -> None:
    async def test(h: Harness) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Register(rogue())
            assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert FINGERPRINT not in (info.value.details() or "")
            assert h.router.registry.get("rogue") is None

    run(test)  # no key at all: the refusal still names only the caller's own value


def test_a_node_registers_heartbeats_and_deregisters_with_its_key() -> None:
    async def test(h: Harness) -> None:
        target = f"127.0.0.1:{h.grpc_port}"
        request = rogue(FINGERPRINT)
        request.instance_id = "keyed-node"
        keyed = RouterRegistration(target, request, _load, node_key="k3y", max_retry_s=0.2)
        keyless = pb.RegisterRequest()
        keyless.CopyFrom(request)
        keyless.instance_id = "keyless-node"
        bare = RouterRegistration(target, keyless, _load, max_retry_s=0.2)
        keyed.start()
        bare.start()
        for _ in range(200):
            if keyed.registered:
                break
            await asyncio.sleep(0.05)
        assert keyed.registered and h.router.registry.get("keyed-node") is not None
        await asyncio.sleep(0.5)  # the keyless one keeps being refused
        assert not bare.registered and h.router.registry.get("keyless-node") is None
        await keyed.stop()
        await bare.stop()
        assert h.router.registry.get("keyed-node") is None  # its Deregister was accepted

    run(test, api_key="k3y")
