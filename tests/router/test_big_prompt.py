"""A 3.9 MB prompt never freezes the router: small requests and heartbeats go on meanwhile.

An in-process router on real uvicorn and a real gRPC port, fake nodes. While one client posts
``{"prompt": "a b " * 975000}`` (just under the 4 MiB body limit), another sends small
completions and a third heartbeats over gRPC; each small request and each heartbeat must be
answered within a generous bound (the prompt used to hold the event loop for ~20 s), and the
big prompt gets its 400. Fast case: the nodes' context is small, so the prompt is refused by its
length before it is tokenized. Slow case: the context is huge, so the prompt is tokenized (off
the loop: tens of seconds on a small machine) and then refused by ``--max-prompt-tokens``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import httpx
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from router.registry import Role
from tests.router.fakes import INFO
from tests.router.inproc import Harness, running_router, serving_http

BIG = {"model": "tiny-llama", "prompt": "a b " * 975000, "max_tokens": 4}
SMALL = {"model": "tiny-llama", "prompt": [1, 400, 401], "max_tokens": 2}
BOUND_S = 5.0  # generous: the failure this guards against is ~20 s and more


async def _small_requests(http: httpx.AsyncClient, done: asyncio.Event) -> list[float]:
    latencies = []
    while not done.is_set():
        start = time.monotonic()
        response = await http.post("/v1/completions", json=SMALL)
        assert response.status_code == 200, response.text
        latencies.append(time.monotonic() - start)
        await asyncio.sleep(0.1)
    return latencies


async def _heartbeats(target: str, done: asyncio.Event) -> list[float]:
    latencies = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        while not done.is_set():
            start = time.monotonic()
            reply = await stub.Heartbeat(pb.HeartbeatRequest(instance_id="decode-0"), timeout=60)
            assert reply.known
            latencies.append(time.monotonic() - start)
            await asyncio.sleep(0.1)
    return latencies


async def _big_prompt_under_load(h: Harness, code: str) -> None:
    async with serving_http(h.router) as url, httpx.AsyncClient(base_url=url, timeout=300) as http:
        done = asyncio.Event()
        small = asyncio.create_task(_small_requests(http, done))
        beats = asyncio.create_task(_heartbeats(f"127.0.0.1:{h.grpc_port}", done))
        await asyncio.sleep(0.5)
        response = await http.post("/v1/completions", json=BIG)
        await asyncio.sleep(0.5)
        done.set()
        small_s, beat_s = await small, await beats
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == code
    assert len(small_s) >= 3 and max(small_s) < BOUND_S, small_s
    assert len(beat_s) >= 3 and max(beat_s) < BOUND_S, beat_s
    assert len(h.router.registry.instances()) == 4  # no node dropped


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing() -> None:
    async def test(h: Harness) -> None:
        start = time.monotonic()
        await _big_prompt_under_load(h, "context_length_exceeded")
        assert time.monotonic() - start < 30  # it was never tokenized

    asyncio.run(_run(test))


@pytest.mark.slow
def test_a_huge_prompt_is_tokenized_off_the_event_loop() -> None:
    async def test(h: Harness) -> None:
        huge = dataclasses.replace(INFO, max_model_len=4_000_000)  # the length check lets it in
        for i, node in enumerate(h.prefill):
            h.router.registry.register(f"prefill-{i}", Role.PREFILL, node.address, huge)
        for i, node in enumerate(h.decode):
            h.router.registry.register(f"decode-{i}", Role.DECODE, node.address, huge)
        await _big_prompt_under_load(h, "context_length_exceeded")

    asyncio.run(_run(test, max_prompt_tokens=100_000))


async def _run(test, **config) -> None:  # type: ignore[no-untyped-def]
    async with running_router(grpc_server=True, **config) as harness:
        await test(harness)
