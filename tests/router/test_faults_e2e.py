"""Node failures under load, end to end: a prefill node and then a decode node are SIGKILLed
while requests are in flight; every request still completes with the offline engine's tokens.

Runs after the other e2e modules (it leaves the session cluster with one node of each kind).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Callable

import grpc
import httpx
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from common.sampling_params import SamplingParams
from tests.router.conftest import Cluster, expected, node_load, wait_no_leaks
from tests.services.nodes import NodeProcess


def prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 1000) for _ in range(rng.randint(low, high))]
            for _ in range(count)]  # fmt: skip


def mixed_params(count: int, max_tokens: int) -> list[SamplingParams]:
    """Half greedy (running to max_tokens), half seeded sampling."""
    return [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if i % 2 == 0
        else SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=max_tokens)
        for i in range(count)
    ]


def to_request(prompt: list[int], params: SamplingParams) -> pb.GenerateRequest:
    message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt))
    sp = message.sampling_params
    sp.temperature, sp.top_p, sp.ignore_eos = params.temperature, params.top_p, params.ignore_eos
    sp.max_tokens = params.max_tokens or 0
    if params.seed is not None:
        sp.seed = params.seed
    return message


def metric(cluster: Cluster, name: str) -> float:
    text = httpx.get(f"{cluster.router.base_url}/metrics", timeout=30).text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def run_and_kill(
    cluster: Cluster,
    requests: list[pb.GenerateRequest],
    victim: NodeProcess,
    ready_to_kill: Callable[[list[int]], bool],
) -> list[list[int]]:
    """Stream every request concurrently; SIGKILL ``victim`` once it is busy and
    ``ready_to_kill(tokens received per stream)``; return each stream's token ids."""
    progress = [0] * len(requests)

    async def stream(stub: pb_grpc.RouterServiceStub, index: int) -> list[int]:
        tokens: list[int] = []
        async for item in stub.Generate(requests[index], timeout=600):
            assert item.finish_reason != pb.FINISH_REASON_ERROR, item.error_message
            tokens.extend(item.token_ids)
            progress[index] = len(tokens)
        return tokens

    async with grpc.aio.insecure_channel(cluster.router.grpc_target) as channel:
        stub = pb_grpc.RouterServiceStub(channel)
        tasks = [asyncio.create_task(stream(stub, i)) for i in range(len(requests))]
        await _wait(lambda: _busy(victim) and ready_to_kill(progress), tasks)
        victim.kill()  # SIGKILL: no drain, no deregistration
        return list(await asyncio.gather(*tasks))


def _busy(node: NodeProcess) -> bool:
    load = node_load(node)
    return load.num_running + load.num_waiting > 0


async def _wait(condition: Callable[[], bool], tasks: list[asyncio.Task[list[int]]]) -> None:
    deadline = time.monotonic() + 300
    while not await asyncio.to_thread(condition):
        assert not all(t.done() for t in tasks), "every request finished before the kill"
        assert time.monotonic() < deadline, "the victim never got busy"
        await asyncio.sleep(0.01)


def check(cluster: Cluster, offline, requests, params, got) -> None:  # type: ignore[no-untyped-def]
    wants = expected(offline, [list(r.token_ids.ids) for r in requests], params)
    for index, (tokens, want) in enumerate(zip(got, wants)):
        assert tokens == want[0].token_ids, f"request {index} differs from offline"


def test_prefill_node_killed_requests_are_retried(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    params = mixed_params(12, max_tokens=6)
    requests = [to_request(p, s) for p, s in zip(prompts(12, 300, 420, seed=5), params)]
    victim = cluster.prefill[0]
    retries_before = metric(cluster, "pdserve_router_prefill_retries_total")
    got = asyncio.run(run_and_kill(cluster, requests, victim, lambda _: True))
    check(cluster, offline, requests, params, got)
    assert metric(cluster, "pdserve_router_prefill_retries_total") > retries_before
    cluster.wait_instances(prefill=1, decode=len(cluster.decode))  # dropped: no heartbeat
    wait_no_leaks(cluster)


def test_decode_node_killed_during_32_streams(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    params = mixed_params(32, max_tokens=96)
    requests = [to_request(p, s) for p, s in zip(prompts(32, 10, 60, seed=9), params)]
    victim = cluster.decode[0]
    migrations_before = metric(cluster, "pdserve_router_decode_migrations_total")

    def streaming(progress: list[int]) -> bool:
        return sum(1 for n in progress if n >= 3) >= 16

    got = asyncio.run(run_and_kill(cluster, requests, victim, streaming))
    check(cluster, offline, requests, params, got)
    assert metric(cluster, "pdserve_router_decode_migrations_total") > migrations_before
    cluster.wait_instances(prefill=1, decode=1)
    wait_no_leaks(cluster)


def test_last_prefill_node_killed_requests_fall_back(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    """SIGKILL the only prefill node mid-prefill: every request completes on the decode node,
    which prefills locally (``--prefill-fallback``, on by default), with the offline tokens;
    ``/ready`` stays 200 with no prefill instance."""
    params = mixed_params(8, max_tokens=6)
    requests = [to_request(p, s) for p, s in zip(prompts(8, 300, 420, seed=13), params)]
    (victim,) = [n for n in cluster.prefill if n.proc.poll() is None]
    got = asyncio.run(run_and_kill(cluster, requests, victim, lambda _: True))
    check(cluster, offline, requests, params, got)
    text = httpx.get(f"{cluster.router.base_url}/metrics", timeout=30).text
    assert 'pdserve_router_prefill_fallbacks_total{reason="prefill_failed"}' in text
    # Ready throughout: the fallback is a prefill path. Until its heartbeat times out the dead
    # node may count again between a failed call's cooldown and its expiry: wait for the expiry.
    deadline = time.monotonic() + 60
    while True:
        ready = httpx.get(f"{cluster.router.base_url}/ready", timeout=30)
        assert ready.status_code == 200, ready.text
        if ready.json()["instances"] == {"prefill": 0, "decode": 1}:
            break
        assert time.monotonic() < deadline, ready.text
        time.sleep(0.2)
    cluster.wait_instances(prefill=0, decode=1)
    wait_no_leaks(cluster)
