"""A request cancelled at any stage (queued, prefilling, loading KV, decoding) or aborted by
``Abort`` frees every block on both nodes, and both nodes keep serving."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import zlib
from collections.abc import Awaitable, Callable

import grpc
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
from tests.services.nodes import Clients, Pair, random_prompts, run, wait_all_free

LONG = 500  # prompt tokens: 16 steps of prefill at --max-num-batched-tokens 32
GREEDY = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True))


def prefill_request(request_id: str, prompt: list[int]) -> pb.PrefillRequest:
    return pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, sampling_params=GREEDY)


def decode_request(request_id: str, prompt: list[int], first: pb.PrefillResponse):
    return pb.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        output_token_ids=[first.first_token_id],
        kv_handle=first.kv_handle,
        sampling_params=GREEDY,
    )


async def poll_load(
    get: Callable[[], Awaitable[pb.LoadReport]],
    ok: Callable[[pb.LoadReport], bool],
    timeout_s: float = 60.0,
) -> pb.LoadReport:
    """Poll a node's GetLoad until ``ok(report)``."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = await get()
        if ok(report):
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"load never matched: {report}")
        await asyncio.sleep(0.005)


class Drained:
    """A server-streaming call read to its end in the background (a stream's status only
    arrives once its messages are read), so ``done()`` means the same as for a unary call."""

    def __init__(self, call: grpc.aio.UnaryStreamCall) -> None:
        self.call = call
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            async for _ in self.call:
                pass

    def done(self) -> bool:
        return self.task.done()

    def cancel(self) -> bool:
        return self.call.cancel()

    def cancelled(self) -> bool:
        return self.call.cancelled()


async def when_running(
    call: grpc.aio.Call | Drained,
    get: Callable[[], Awaitable[pb.LoadReport]],
    then: Callable[[], Awaitable],
    ok: Callable[[pb.LoadReport], bool] = lambda r: r.num_running > 0,
) -> bool:
    """Once the node's load satisfies ``ok`` (default: a request is running) and ``call`` is
    still in flight, ``await then()``. False if the call finished first (the caller retries)."""
    while not call.done():
        if ok(await get()) and not call.done():
            await then()
            return True
        await asyncio.sleep(0.002)
    return False


async def cancelled(call: grpc.aio.Call | Drained) -> bool:
    """Cancel ``call``; False if it had already completed (the cancel came too late)."""
    return call.cancel()


async def check_still_serving(clients: Clients, tag: str) -> None:
    await wait_all_free(clients)
    prompt = random_prompts([20], seed=zlib.crc32(tag.encode()))[0]
    params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=4))
    flow = await clients.flow(f"after-{tag}", prompt, params)
    assert len(flow.tokens) == 4
    await wait_all_free(clients)


def test_cancel_while_queued(file_pair: Pair) -> None:
    blockers = random_prompts([LONG] * 3, seed=10)
    victim = random_prompts([30], seed=11)[0]

    async def go(clients: Clients) -> None:
        load = lambda: clients.prefill.GetLoad(pb.GetLoadRequest())  # noqa: E731
        calls = [
            clients.prefill.Prefill(prefill_request(f"q-block-{i}", p))
            for i, p in enumerate(blockers)
        ]
        await poll_load(load, lambda r: r.num_running + r.num_waiting == 3)
        call = clients.prefill.Prefill(prefill_request("q-victim", victim))
        # FCFS: while anything waits, the request that came last does
        in_core = lambda r: r.num_running + r.num_waiting == 1 + sum(not c.done() for c in calls)  # noqa: E731
        await poll_load(load, lambda r: r.num_waiting > 0 and in_core(r))
        assert await cancelled(call)
        for blocker in calls:
            await cancelled(blocker)
        await check_still_serving(clients, "queued")

    run(go, file_pair)


def test_cancel_during_prefill(file_pair: Pair) -> None:
    """Cancel once the prefill node reports the prompt running (retried with a fresh prompt if
    the prefill won the race and finished first)."""

    async def go(clients: Clients) -> None:
        load = lambda: clients.prefill.GetLoad(pb.GetLoadRequest())  # noqa: E731
        for attempt in range(5):
            prompt = random_prompts([LONG], seed=100 + attempt)[0]
            call = clients.prefill.Prefill(prefill_request(f"p-cancel-{attempt}", prompt))
            cancel = functools.partial(cancelled, call)
            if await when_running(call, load, cancel) and call.cancelled():
                break  # cancelled while its prompt was being computed
        else:
            pytest.fail("every prefill finished before its cancel arrived")
        await check_still_serving(clients, "prefill")

    run(go, file_pair)


def test_cancel_during_transfer(file_pair: Pair) -> None:
    """Cancel a Decode once the decode node holds it but runs nothing: its KV is loading from
    the store (or has just landed). Retried if the request got to decoding first."""

    async def go(clients: Clients) -> None:
        load = lambda: clients.decode.GetLoad(pb.GetLoadRequest())  # noqa: E731
        for attempt in range(8):
            rid, prompt = f"t-cancel-{attempt}", random_prompts([LONG], seed=300 + attempt)[0]
            first = await clients.prefill.Prefill(prefill_request(rid, prompt))
            call = Drained(clients.decode.Decode(decode_request(rid, prompt, first)))
            waiting = lambda r: r.num_waiting > 0 and r.num_running == 0  # noqa: E731
            cancel = functools.partial(cancelled, call)
            if await when_running(call, load, cancel, waiting) and call.cancelled():
                break
        else:
            pytest.fail("every decode got past its KV load before the cancel")
        await check_still_serving(clients, "transfer")

    run(go, file_pair)


def test_cancel_during_decode(file_pair: Pair) -> None:
    prompt = random_prompts([40], seed=14)[0]

    async def go(clients: Clients) -> None:
        first = await clients.prefill.Prefill(prefill_request("d-cancel", prompt))
        call = clients.decode.Decode(decode_request("d-cancel", prompt, first))
        received = 0
        async for msg in call:
            received += len(msg.token_ids)
            if received >= 3:
                break
        call.cancel()
        await check_still_serving(clients, "decode")

    run(go, file_pair)


def test_abort_rpc_on_prefill(file_pair: Pair) -> None:
    async def go(clients: Clients) -> None:
        load = lambda: clients.prefill.GetLoad(pb.GetLoadRequest())  # noqa: E731
        for attempt in range(5):
            rid = f"a-prefill-{attempt}"
            prompt = random_prompts([LONG], seed=200 + attempt)[0]
            call = clients.prefill.Prefill(prefill_request(rid, prompt))
            abort = lambda rid=rid: clients.prefill.Abort(pb.AbortRequest(request_id=rid))  # noqa: E731
            if await when_running(call, load, abort) and (await call).finish_reason:
                break
        else:
            pytest.fail("every prefill finished before its abort arrived")
        first = await call
        assert first.finish_reason == pb.FINISH_REASON_ABORT
        assert not first.HasField("kv_handle")
        await check_still_serving(clients, "abort-prefill")

    run(go, file_pair)


def test_abort_rpc_on_decode(file_pair: Pair) -> None:
    prompt = random_prompts([40], seed=15)[0]

    async def go(clients: Clients) -> None:
        first = await clients.prefill.Prefill(prefill_request("a-decode", prompt))
        stream = clients.decode.Decode(decode_request("a-decode", prompt, first))
        messages = []
        async for msg in stream:
            messages.append(msg)
            if len(messages) == 2:
                reply = await clients.decode.Abort(pb.AbortRequest(request_id="a-decode"))
                assert reply.found
        assert messages[-1].finish_reason == pb.FINISH_REASON_ABORT
        assert messages[-1].usage.completion_tokens == sum(len(m.token_ids) for m in messages) + 1
        unknown = await clients.decode.Abort(pb.AbortRequest(request_id="no-such-request"))
        assert not unknown.found
        await check_still_serving(clients, "abort-decode")

    run(go, file_pair)
