"""Engine-core messages round-trip and refuse anything malformed; ``CoreClient`` against a real
engine-core process: streams, ``n > 1``, cancellation, load, malformed input, failures, a clean
shutdown, and cross-instance prefix reuse through the KV store."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import signal

import grpc
import msgspec
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import sampling_params_to_proto

from common.config import EngineConfig
from common.core_client import CoreClient, CoreRequestError
from common.core_messages import (
    AbortRequests,
    AddRequest,
    GetLoad,
    LoadStats,
    Message,
    Outputs,
    Ready,
    RequestError,
    RequestTiming,
    Shutdown,
    decode,
    encode,
)
from common.kv_interface import KVHandle
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams, child_seed
from common.step_outputs import EngineCoreOutput
from kv_transfer.connector import create_store_connector
from tests.services.nodes import Pair, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
GREEDY_WIRE = sampling_params_to_proto(GREEDY)


HANDLE = KVHandle("fp-1", 16, 20, [b"a" * 32, b"b" * 32], "file:///tmp/x")
OUTPUT = EngineCoreOutput(
    "r1",
    [7],
    [TokenLogprobs(7, -0.5, [7, 9], [-0.5, -1.5])],
    "stop",
    7,
    num_cached_tokens=16,
    kv_handle=HANDLE,
    num_external_tokens=4,
)
MESSAGES = [
    AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, seed=3, stop_token_ids=[9]), 2),
    AddRequest("r2", [1], SamplingParams(), output_token_ids=[4, 5], kv_handle=HANDLE),
    AbortRequests(["r1", "r2"]),
    GetLoad(7),
    Shutdown(),
    Ready("tiny-llama", 1024, 512, 16, 512, 32, "fp-1", 123),
    Outputs([OUTPUT, EngineCoreOutput("r2", [], [], "abort")], [RequestTiming(1, 2, 3), None]),
    RequestError("r3", "invalid_argument", "prompt is empty"),
    LoadStats(1, 2, 384, 512, 40, query_id=7),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_messages_round_trip(message: Message) -> None:
    assert decode(encode(message)) == message


def _add_request_bytes(**changes: object) -> bytes:
    body = msgspec.to_builtins(AddRequest("r1", [1, 2], SamplingParams()))
    return msgspec.msgpack.encode({**body, **changes})


@pytest.mark.parametrize(
    "data, error",
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode([1, 2]), "Expected `object`"),
        (msgspec.msgpack.encode({"kind": "nope"}), "Invalid value 'nope'"),
        (msgspec.msgpack.encode({"kind": "get_load"}), "missing required field `query_id`"),
        (msgspec.msgpack.encode({"kind": "get_load", "query_id": "7"}), "Expected `int`"),
        (msgspec.msgpack.encode({"kind": "abort", "request_ids": [], "x": 1}), "unknown field"),
        (_add_request_bytes(prompt_token_ids="12"), "Expected `array`"),
        (_add_request_bytes(sampling_params={"temperature": -1.0}), "temperature must be >= 0"),
        (_add_request_bytes(sampling_params={"top_k": 1.5}), "Expected `int`"),
    ],
)
def test_malformed_messages_are_value_errors(data: bytes, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        decode(data)


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


@pytest.mark.slow
def test_shutdown_of_a_starting_core_does_not_wait_for_it() -> None:
    """A core still loading its model reads no Shutdown: it is terminated at once (Ctrl-C of
    `up` while a replacement node started waited the 30 s join for it)."""
    from common.models.shapes import write_dummy_shape

    big = str(write_dummy_shape("llama-3.2-1b", num_layers=2))  # seconds of dummy weights

    async def go() -> float:
        config = EngineConfig.from_kwargs(
            model=big, load_format="dummy", num_blocks=16, max_model_len=256, cpu_threads=1
        )
        client = CoreClient(config)
        start = asyncio.ensure_future(client.start())
        await asyncio.sleep(1.0)
        assert client.info is None and not start.done(), "the core was ready too soon"
        began = asyncio.get_running_loop().time()
        await client.shutdown()
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        return asyncio.get_running_loop().time() - began

    took = asyncio.run(go())
    assert took < 10.0, took  # the Shutdown message path would wait its 30 s join
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
        await _malformed_messages_leave_the_core_up(client)

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


def test_engine_steps_count_the_loop_and_a_stopped_core_keeps_its_last_load() -> None:
    """``engine_steps`` (the liveness count a node reports) moves while the core works; a
    stopped core answers no load query, and its last answer stands (a node reports that)."""

    async def go() -> None:
        client = CoreClient(_config())
        info = await client.start()
        before = (await client.get_load()).engine_steps
        await _collect(client, "a", GREEDY)
        working = asyncio.create_task(_collect(client, "long", LONG))
        while (load := await client.get_load()).num_running == 0:
            await asyncio.sleep(0.01)
        assert load.engine_steps > before
        os.kill(info.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(0.2)  # whatever it sent before it stopped has arrived
            stopped = client.last_load
            with pytest.raises(asyncio.TimeoutError):
                await client.get_load(timeout_s=0.5)
            assert client.last_load is stopped
        finally:
            os.kill(info.pid, signal.SIGCONT)
        assert (await client.get_load()).engine_steps > stopped.engine_steps  # type: ignore[union-attr]
        working.cancel()
        await asyncio.gather(working, return_exceptions=True)
        await client.shutdown()

    asyncio.run(go())
    assert multiprocessing.active_children() == []


async def _malformed_messages_leave_the_core_up(client: CoreClient) -> None:
    """Bytes that are no message are dropped; an ``AddRequest`` that does not decode (here: its
    sampling params fail validation, checked again in the core) is refused; the core serves on."""
    not_for_the_core = Ready("m", 1, 1, 1, 1, 1, None, 1)
    for data in (b"\xc1", msgspec.msgpack.encode({"kind": "nope"}), encode(not_for_the_core)):
        client._input.send(data)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    params.temperature = -1.0  # bypasses the frontend's own check
    with pytest.raises(CoreRequestError, match="temperature must be >= 0") as refused:
        await _collect(client, "malformed", params)
    assert refused.value.code == "invalid_argument"
    assert len(await _collect(client, "after-malformed", GREEDY)) >= 1
    assert (await client.get_load()).num_running == 0


def test_n_samples_are_split_in_the_client() -> None:
    """``n > 1`` reaches the core as ``n`` requests: every sample's outputs come back through one
    stream, tagged with its index, with the tokens of the ``n == 1`` request seeded
    ``child_seed(seed, i)``; closing the stream aborts every sample."""
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)

    async def go() -> None:
        client = CoreClient(_config())
        await client.start()
        try:
            samples: dict[int, list[int]] = {0: [], 1: [], 2: []}
            async with client.add_request("fan", list(range(5, 40)), params) as stream:
                async for item in stream:
                    samples[item.index] += item.output.new_token_ids
            for i, tokens in samples.items():
                single = dataclasses.replace(params, n=1, seed=child_seed(5, i))
                assert await _collect(client, f"one-{i}", single) == tokens
            assert client.num_requests == 0

            consumer = asyncio.create_task(_collect(client, "long", dataclasses.replace(LONG, n=2)))
            while (await client.get_load()).num_running < 2:
                await asyncio.sleep(0.01)
            consumer.cancel()
            await asyncio.gather(consumer, return_exceptions=True)
            await _wait_free(client)
            with pytest.raises(CoreRequestError, match="over its cap"):
                await _collect(client, "many", dataclasses.replace(GREEDY, n=17))
        finally:
            await client.shutdown()

    asyncio.run(go())


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
        client = CoreClient(config, connector_factory=create_store_connector)
        await client.start()
        try:
            async with client.add_request("x-instance", prompt, greedy) as stream:
                item = await anext(stream)
        finally:
            await client.shutdown()
        assert item.output.new_token_ids == [first.first_token_id]
        assert item.output.num_external_tokens == 64  # 4 full blocks; the rest is computed

    asyncio.run(go())
