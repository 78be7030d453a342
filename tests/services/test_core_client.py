"""``CoreClient`` against a real engine-core process: streams, cancellation, load, failures, a
clean shutdown, and cross-instance prefix reuse through the KV store."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import grpc
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from common.config import EngineConfig
from common.core_client import CoreClient, CoreRequestError
from common.sampling_params import SamplingParams
from node_frontend.convert import sampling_params_to_proto
from tests.services.nodes import Pair, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
GREEDY_WIRE = sampling_params_to_proto(GREEDY)


def _config(**overrides: object) -> EngineConfig:
    args = dict(num_blocks=64, max_model_len=256, max_num_batched_tokens=32, cpu_threads=1)
    return EngineConfig.from_kwargs(model="tiny-llama", **{**args, **overrides})


async def _collect(
    client: CoreClient, request_id: str, params: SamplingParams, prompt: list[int] | None = None
) -> list[int]:
    tokens: list[int] = []
    prompt = list(range(5, 40)) if prompt is None else prompt
    async with client.add_request(request_id, prompt, params) as stream:
        async for item in stream:
            tokens += item.output.new_token_ids
    return tokens


async def _wait_free(client: CoreClient) -> None:
    for _ in range(1000):
        load = await client.get_load()
        if load.num_free_blocks == load.num_total_blocks and load.num_running == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks still held: {load}")


def test_failed_start_is_reported_and_leaves_nothing() -> None:
    async def go() -> None:
        client = CoreClient(_config(num_blocks=4))
        with pytest.raises(RuntimeError, match="KV cache has 4 blocks"):
            await client.start()

    asyncio.run(go())
    assert multiprocessing.active_children() == []


def test_stream_cancel_load_death_and_shutdown() -> None:
    async def go() -> None:
        client = CoreClient(_config())
        info = await client.start()
        assert (info.num_total_blocks, info.max_model_len) == (64, 256)
        assert len(await _collect(client, "a", GREEDY)) >= 1
        with pytest.raises(CoreRequestError) as refused:
            await _collect(client, "bad", GREEDY, prompt=[5, 4096])
        assert refused.value.code == "invalid_argument"

        consumer = asyncio.create_task(_collect(client, "long", LONG))
        while (await client.get_load()).num_running == 0:
            await asyncio.sleep(0.01)
        consumer.cancel()  # the consumer goes away: the request is aborted in the core
        await asyncio.gather(consumer, return_exceptions=True)
        await _wait_free(client)
        assert client.num_requests == 0

        victim = asyncio.create_task(_collect(client, "orphan", LONG))
        while (await client.get_load()).num_running == 0:
            await asyncio.sleep(0.01)
        os.kill(info.pid, signal.SIGKILL)
        with pytest.raises(CoreRequestError) as died:
            await victim
        assert died.value.code == "unavailable" and "exited" in died.value.message
        assert "exited" in await asyncio.wait_for(client.wait_failed(), 30)
        with pytest.raises(CoreRequestError):
            await _collect(client, "after-death", GREEDY)
        await client.shutdown()

    asyncio.run(go())
    assert multiprocessing.active_children() == []


def test_prefix_stored_by_another_instance_is_loaded(file_pair: Pair) -> None:
    """An engine with the prefill nodes' KV role (``both``) loads what the prefill node stored:
    cross-instance prefix reuse, with the same first token."""
    prompt = random_prompts([70], seed=70)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=1)

    async def go() -> None:
        channel = grpc.aio.insecure_channel(file_pair.prefill.address)
        stub = pb_grpc.PrefillServiceStub(channel)
        request = pb.PrefillRequest(
            request_id="x-instance", prompt_token_ids=prompt, sampling_params=GREEDY_WIRE
        )
        first = await stub.Prefill(request)
        await channel.close()
        config = _config(kv_store=file_pair.store_url, kv_role="both", max_model_len=512)
        client = CoreClient(config)
        await client.start()
        try:
            async with client.add_request("x-instance", prompt, greedy) as stream:
                item = await anext(stream)
        finally:
            await client.shutdown()
        assert item.output.new_token_ids == [first.first_token_id]
        assert item.output.num_external_tokens == 64  # 4 full blocks; the rest is computed

    asyncio.run(go())
