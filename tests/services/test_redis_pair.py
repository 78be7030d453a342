"""A prefill + decode pair on a real redis-server, registered with a (fake) router: exact tokens,
router registration, the admission bound, and SIGTERM drain. The tests run in file order and the
last one stops the nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
from tests.conftest import RedisServer
from tests.services.conftest import start_pair
from tests.services.nodes import (
    Clients,
    FakeRouter,
    Pair,
    Reference,
    check_equivalence,
    random_prompts,
    run,
    wait_all_free,
    wait_for,
)

MAX_NUM_SEQS, MAX_QUEUE = 4, 4
PREFILL, DECODE = "role_prefill", "role_decode"


@pytest.fixture(scope="module")
def router() -> Iterator[FakeRouter]:
    fake = FakeRouter(heartbeat_interval_s=0.2).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="module")
def redis_pair(tmp_path_factory: pytest.TempPathFactory, router: FakeRouter) -> Iterator[Pair]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    flags = ("--max-num-seqs", str(MAX_NUM_SEQS), "--max-queue", str(MAX_QUEUE))
    flags += ("--router", router.address, "--drain-timeout", "120")
    pair = start_pair(server.url, tmp_path_factory.mktemp("node-logs"), *flags)
    yield pair
    pair.prefill.kill()  # normally already stopped by the drain test
    pair.decode.kill()
    server.kill()


def test_registers_and_heartbeats(redis_pair: Pair, router: FakeRouter) -> None:
    for prefix, node in ((PREFILL, redis_pair.prefill), (DECODE, redis_pair.decode)):
        wait_for(lambda p=prefix: router.count("heartbeat", p) >= 2, what=f"{prefix} heartbeats")
        register = router.last("register", prefix)
        assert register.address == node.address
        # The node's layout, from its engine: the router learns block size and context here.
        info = register.info
        assert (info.model, info.block_size, info.max_model_len) == ("tiny-llama", 16, 512)
        assert register.load.num_total_blocks == 512
        assert router.last("heartbeat", prefix).load.max_num_seqs == MAX_NUM_SEQS
    prefill, decode = router.last("register", PREFILL), router.last("register", DECODE)
    assert (prefill.role, decode.role) == (pb.ROLE_PREFILL, pb.ROLE_DECODE)
    assert prefill.info.fingerprint and prefill.info.fingerprint == decode.info.fingerprint


def test_registers_again_when_forgotten(redis_pair: Pair, router: FakeRouter) -> None:
    before = {p: router.count("register", p) for p in (PREFILL, DECODE)}
    router.known = False
    try:
        for prefix in (PREFILL, DECODE):
            wait_for(lambda p=prefix: router.count("register", p) > before[p], what="re-register")
    finally:
        router.known = True


def test_keeps_trying_while_router_is_down(redis_pair: Pair, router: FakeRouter) -> None:
    port = router.port
    router.stop()
    outage_end = time.monotonic() + 1.0  # long enough for several failed heartbeats
    while time.monotonic() < outage_end:
        time.sleep(0.1)
    before = {p: router.count("register", p) for p in (PREFILL, DECODE)}
    router.start(port)
    for prefix in (PREFILL, DECODE):
        wait_for(lambda p=prefix: router.count("register", p) > before[p], what="register again")


def test_redis_store_matches_offline_engine(redis_pair: Pair, reference: Reference) -> None:
    check_equivalence(redis_pair, reference, seed=5, concurrency=MAX_NUM_SEQS)


def test_queue_bound_gives_resource_exhausted(redis_pair: Pair) -> None:
    prompts = random_prompts([20] * (MAX_NUM_SEQS + MAX_QUEUE + 1), seed=40)
    wire = sampling_params_to_proto(SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))

    def request(i: int) -> pb.DecodeRequest:
        return pb.DecodeRequest(
            request_id=f"bound-{i}",
            prompt_token_ids=prompts[i],
            output_token_ids=[prompts[i][0]],
            sampling_params=wire,
        )

    async def go(clients: Clients) -> None:
        calls = [clients.decode.Decode(request(i)) for i in range(len(prompts) - 1)]
        deadline = time.monotonic() + 60
        while (
            load := await clients.decode.GetLoad(pb.GetLoadRequest())
        ).num_running + load.num_waiting < len(calls):
            assert time.monotonic() < deadline, load
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await clients.decode.Decode(request(len(prompts) - 1)).read()
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "queue is full" in info.value.details()
        for call in calls:
            call.cancel()
        await wait_all_free(clients)

    run(go, redis_pair)


async def _refuses(channel: grpc.aio.Channel, late: Callable[[], Awaitable[object]]) -> None:
    """After SIGTERM: health turns NOT_SERVING (or the node is gone) and new work gets
    UNAVAILABLE."""
    health = health_pb2_grpc.HealthStub(channel)
    while True:
        try:
            reply = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.aio.AioRpcError:
            break  # already stopped
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            break
        await asyncio.sleep(0.005)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await late()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


async def _read_rest(stream: grpc.aio.UnaryStreamCall) -> list[pb.DecodeResponse]:
    """Read a stream to its end with ``read()`` (which cannot be mixed with ``async for``)."""
    messages = []
    while (msg := await stream.read()) is not grpc.aio.EOF:
        messages.append(msg)
    return messages


def test_sigterm_drains_without_dropping(
    redis_pair: Pair, router: FakeRouter, reference: Reference
) -> None:
    """SIGTERM while every slot is busy: all in-flight requests finish, new ones get
    UNAVAILABLE, the node deregisters and exits 0. Prefill first, then decode."""
    prompts = random_prompts([256] * (MAX_NUM_SEQS + MAX_QUEUE), seed=50)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    expected = reference.generate(prompts, [params] * len(prompts))
    wire = sampling_params_to_proto(params)

    async def go(clients: Clients) -> None:
        calls = [
            clients.prefill.Prefill(
                pb.PrefillRequest(request_id=f"drain-{i}", prompt_token_ids=p, sampling_params=wire)
            )
            for i, p in enumerate(prompts)
        ]
        await _wait_in_core(clients.prefill, len(calls))
        redis_pair.prefill.terminate()
        late = pb.PrefillRequest(request_id="late", prompt_token_ids=[5, 6], sampling_params=wire)
        await _refuses(clients.channels[0], lambda: clients.prefill.Prefill(late))
        firsts = await asyncio.gather(*calls)
        assert redis_pair.prefill.wait() == 0

        streams = [
            clients.decode.Decode(_decode(f"drain-{i}", p, f, wire))
            for i, (p, f) in enumerate(zip(prompts, firsts))
        ]
        await _wait_in_core(clients.decode, len(streams))
        redis_pair.decode.terminate()
        late_decode = _decode("late", prompts[0], firsts[0], wire)
        await _refuses(clients.channels[1], lambda: _read_rest(clients.decode.Decode(late_decode)))
        tails = await asyncio.gather(*(_read_rest(s) for s in streams))
        assert redis_pair.decode.wait() == 0
        for first, tail, (tokens, _) in zip(firsts, tails, expected):
            got = [first.first_token_id] + [t for m in tail for t in m.token_ids]
            assert got == tokens
            assert tail[-1].finish_reason == pb.FINISH_REASON_LENGTH

    run(go, redis_pair)
    assert router.count("deregister", PREFILL) == 1
    assert router.count("deregister", DECODE) == 1


async def _wait_in_core(
    stub: pb_grpc.PrefillServiceStub | pb_grpc.DecodeServiceStub, count: int
) -> None:
    """Until the node's engine holds ``count`` requests (running or waiting)."""
    deadline = time.monotonic() + 60
    while True:
        load = await stub.GetLoad(pb.GetLoadRequest())
        if load.num_running + load.num_waiting >= count:
            return
        assert time.monotonic() < deadline, load
        await asyncio.sleep(0.01)


def _decode(
    rid: str, prompt: list[int], first: pb.PrefillResponse, wire: pb.SamplingParams
) -> pb.DecodeRequest:
    return pb.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=[first.first_token_id],
        kv_handle=first.kv_handle,
        sampling_params=wire,
    )
