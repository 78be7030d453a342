"""The poison request of issue 26 against real processes: two prefill nodes stay up.

``prompt_logprobs=1000000`` over gRPC once reached every prefill engine's ``topk``, which
raised and killed the node; the router retried it on the next. Now the router refuses it from
the same table HTTP uses (INVALID_ARGUMENT), a prefill node reached directly refuses it at
its engine's door, and the pool keeps serving.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc
import httpx
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from tests.router.conftest import Cluster, wait_no_leaks

POISON = pb.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1000000)


async def _generate(target: str, params: pb.SamplingParams) -> list[pb.GenerateResponse]:
    async with grpc.aio.insecure_channel(target) as channel:
        request = pb.GenerateRequest(text="hello", sampling_params=params)
        stub = pb_grpc.RouterServiceStub(channel)
        return [item async for item in stub.Generate(request, timeout=120)]


async def _prefill(address: str, params: pb.SamplingParams) -> pb.PrefillResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        request = pb.PrefillRequest(
            request_id=f"poison-{uuid.uuid4().hex}",
            prompt_token_ids=[1, 400, 401, 402],
            sampling_params=params,
        )
        return await pb_grpc.PrefillServiceStub(channel).Prefill(request, timeout=120)


def test_grpc_poison_request_leaves_both_prefill_nodes_up(cluster: Cluster) -> None:
    async def go() -> None:
        for _ in range(3):  # three in a row used to retire the prefill pool
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _generate(cluster.router.grpc_target, POISON)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_logprobs must be in [0, 5]" in (info.value.details() or "")
        for node in cluster.prefill:  # past the router: the engine refuses it at its door
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await _prefill(node.address, POISON)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "exceeds the vocabulary" in (info.value.details() or "")
        good = pb.SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
        items = await _generate(cluster.router.grpc_target, good)
        assert sum(len(i.token_ids) for i in items) == 4
        assert len(items[0].prompt_logprobs.tokens) > 0

    asyncio.run(go())
    assert all(node.proc.poll() is None for node in cluster.prefill)
    cluster.wait_instances(len(cluster.prefill), len(cluster.decode), timeout_s=10)
    health = httpx.get(f"{cluster.router.base_url}/health", timeout=10).json()
    assert health["instances"]["prefill"] == 2
    wait_no_leaks(cluster)
