"""The request flow against fake nodes: retries, migration, stop strings, aborts, n, limits.

Every test runs an in-process router (``tests.router.inproc``) inside ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import sampling_params_from_proto
from pdserve_proto.nodes import NodeLoad

from common.sampling_params import SamplingParams, child_seed
from router.errors import RouterError
from router.flow import Usage
from router.registry import Role
from tests.router.fakes import INFO, fake_tokens
from tests.router.inproc import Harness, running_router

PROMPT = [1, 300, 301, 302, 303]


def run(test: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        async with running_router(**kwargs) as harness:
            await test(harness)

    asyncio.run(main())


async def generate(h: Harness, **params: Any) -> tuple[dict[int, list[int]], str, Usage]:
    """Run one request through the core; token ids per sample, sample 0's text, usage."""
    params.setdefault("temperature", 0.0)
    params.setdefault("max_tokens", 8)
    spec = h.router.core.prepare(list(PROMPT), SamplingParams(**params))
    usage = Usage()
    tokens: dict[int, list[int]] = {}
    text = ""
    async for delta in h.router.core.run(spec, usage, "test"):
        tokens.setdefault(delta.index, []).extend(delta.token_ids)
        text += delta.text if delta.index == 0 else ""
    return tokens, text, usage


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_tokens_flow_through_and_seed_is_always_set() -> None:
    async def test(h: Harness) -> None:
        tokens, _, usage = await generate(h, seed=3, max_tokens=8)
        assert tokens == {0: fake_tokens(3, 8)}
        assert (usage.prompt_tokens, usage.completion_tokens) == (5, 8)
        await generate(h, max_tokens=2)  # no client seed: the router draws one
        requests = [r for s in h.scripts("prefill") for r in s.requests]
        assert len(requests) == 2 and all(r.sampling_params.HasField("seed") for r in requests)

    run(test)


def test_failed_prefill_is_retried_on_another_instance() -> None:
    async def test(h: Harness) -> None:
        h.prefill[0].script.fail = "unavailable"
        tokens, _, usage = await generate(h, seed=4, max_tokens=6)
        assert tokens == {0: fake_tokens(4, 6)}
        assert usage.retries == 1 and len(h.prefill[0].script.seen) == 1
        # The failed instance is suspect: the next request goes straight to the other one.
        await generate(h, seed=5, max_tokens=2)
        assert len(h.prefill[0].script.seen) == 1

    run(test)


@pytest.mark.parametrize(
    ("fail", "status", "code"),
    [("unavailable", 503, "no_healthy_instance"), ("busy", 429, "overloaded"),
     ("invalid", 400, None)],
)  # fmt: skip
def test_prefill_failures_everywhere(fail: str, status: int, code: str | None) -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("prefill"):
            script.fail = fail
        with pytest.raises(RouterError) as info:
            await generate(h, max_tokens=4)
        assert (info.value.status, info.value.code) == (status, code)
        tried = sum(len(s.seen) for s in h.scripts("prefill"))
        assert tried == (1 if fail == "invalid" else 2)  # a bad request is not retried

    run(test, prefill_fallback=False)  # with it, "unavailable" falls back (test_fallback.py)


def test_no_instances_is_503() -> None:
    async def test(h: Harness) -> None:
        with pytest.raises(RouterError) as info:
            await generate(h, max_tokens=4)
        assert info.value.status == 503
        response = await h.http.post(
            "/v1/completions", json={"prompt": [1, 2], "max_tokens": 3, "stream": True}
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_instance"
        # No node has said how long its context is: nor can the router.
        card = (await h.http.get("/v1/models")).json()["data"][0]
        assert card["max_model_len"] is None

    run(test, num_prefill=0, num_decode=0)


@pytest.mark.parametrize("cap", [None, 256])
def test_the_context_is_the_nodes(cap: int | None) -> None:
    """/v1/models and the length checks use the registered nodes' max_model_len (capped by the
    router's --max-model-len when given)."""
    limit = cap or INFO.max_model_len

    async def test(h: Harness) -> None:
        card = (await h.http.get("/v1/models")).json()["data"][0]
        assert card["max_model_len"] == limit
        body = {"prompt": [5] * limit, "max_tokens": 1}
        response = await h.http.post("/v1/completions", json=body)
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"max_model_len) is {limit} tokens" in error["message"]
        body = {"prompt": [5] * (limit - 2), "max_tokens": 2}
        assert (await h.http.post("/v1/completions", json=body)).status_code == 200

    run(test, max_model_len=cap)


def test_prefill_hand_off_is_explicit() -> None:
    """A prefill reply says what happens next: HANDED_OFF goes on to a decode node; a finish
    at the first token (the request's own) ends it there; a reply that says neither is a node
    failure, retried on another prefill node."""

    async def test(h: Harness) -> None:
        tokens, _, usage = await generate(h, seed=2, max_tokens=1)
        assert tokens == {0: fake_tokens(2, 1)} and usage.completion_tokens == 1
        for script in h.scripts("prefill"):
            script.prefill_finish = pb.FINISH_REASON_STOP  # EOS as the first token
        tokens, _, _ = await generate(h, seed=3, max_tokens=5)
        assert tokens == {0: fake_tokens(3, 1)}
        assert not any(s.seen for s in h.scripts("decode"))
        for script in h.scripts("prefill"):
            script.prefill_finish = pb.FINISH_REASON_HANDED_OFF
        odd = h.prefill[0].script
        odd.prefill_finish, odd.seen = pb.FINISH_REASON_UNSPECIFIED, []
        busy = h.router.registry.get("prefill-1")
        busy.load = NodeLoad(queued_prompt_tokens=10_000)  # so prefill-0 is asked first
        tokens, _, usage = await generate(h, seed=4, max_tokens=5)
        assert tokens == {0: fake_tokens(4, 5)}
        assert usage.retries == len(odd.seen) == 1

    run(test)


def test_the_router_holds_the_floats_the_nodes_read() -> None:
    """HTTP floats (float64 in JSON) are rounded once, as the wire rounds them: the router's
    spec and the node's engine hold the same values; a non-finite one is a 400."""

    async def test(h: Harness) -> None:
        body = {"prompt": [1, 300], "max_tokens": 2, "temperature": 0.123456789, "top_p": 0.3}
        assert (await h.http.post("/v1/completions", json=body)).status_code == 200
        [sent] = [r for s in h.scripts("prefill") for r in s.requests]
        node = sampling_params_from_proto(sent.sampling_params)
        spec = h.router.core.prepare([1, 300], SamplingParams(temperature=0.123456789, top_p=0.3))
        assert (spec.params.temperature, spec.params.top_p) == (node.temperature, node.top_p)
        assert (node.temperature, node.top_p) == (0.12345679, 0.3)
        for bad in (float("nan"), float("inf"), 1e39):
            with pytest.raises(RouterError) as info:
                h.router.core.prepare([1, 300], SamplingParams(temperature=bad))
            assert info.value.status == 400

    run(test)


@pytest.mark.parametrize("tokens_per_item", [1, 3])
def test_decode_dies_mid_stream_and_resumes_exactly(tokens_per_item: int) -> None:
    async def test(h: Harness) -> None:
        first, second = h.scripts("decode")  # a fresh balancer picks decode-0 first
        first.die_after = 2
        first.tokens_per_item = second.tokens_per_item = tokens_per_item
        tokens, _, usage = await generate(h, seed=11, max_tokens=16)
        assert tokens == {0: fake_tokens(11, 16)}  # no duplicate, no gap
        assert usage.migrations == 1 and len(first.seen) == len(second.seen) == 1
        resumed = second.requests[0]
        assert list(resumed.output_token_ids) == fake_tokens(11, 1 + 2 * tokens_per_item)
        assert resumed.sampling_params == first.requests[0].sampling_params

    run(test)


def test_stalled_decode_resumes_elsewhere() -> None:
    async def test(h: Harness) -> None:
        stalled, healthy = h.scripts("decode")  # a fresh balancer picks decode-0 first
        stalled.delay_s = 30.0
        tokens, _, usage = await generate(h, seed=6, max_tokens=5)
        assert tokens == {0: fake_tokens(6, 5)} and usage.migrations == 1
        assert list(healthy.requests[0].output_token_ids) == fake_tokens(6, 1)
        await wait_for(lambda: stalled.cancelled == stalled.seen == stalled.aborted)

    run(test, decode_stall_timeout_s=0.5)


def test_a_decode_stream_with_no_token_for_the_progress_timeout_resumes_elsewhere() -> None:
    """The per-token deadline: no item for --progress-timeout from a node the router cannot
    see live and full (here: no report at all) moves the request at once, long before the
    --decode-stall-timeout cap."""

    async def test(h: Harness) -> None:
        stalled, healthy = h.scripts("decode")
        stalled.delay_s = 30.0
        start = asyncio.get_running_loop().time()
        tokens, _, usage = await generate(h, seed=6, max_tokens=5)
        assert asyncio.get_running_loop().time() - start < 5.0
        assert tokens == {0: fake_tokens(6, 5)} and usage.migrations == 1
        assert list(healthy.requests[0].output_token_ids) == fake_tokens(6, 1)

    run(test, progress_timeout_s=0.5)


def test_a_stream_on_a_live_full_node_waits_past_the_deadline() -> None:
    """A request that gets no token from a node whose engine turns and whose seats are all
    taken may be queued there: it waits (up to --decode-stall-timeout) instead of moving."""

    async def test(h: Harness) -> None:
        for script in h.scripts("decode"):
            script.delay_s = 0.7  # between items: over the 0.3 s deadline every time

        async def heartbeats() -> None:
            for steps in range(1000):
                for name in ("decode-0", "decode-1"):
                    load = NodeLoad(num_running=4, max_num_seqs=4, num_requests=5)
                    h.router.registry.heartbeat(name, replace(load, engine_steps=steps))
                await asyncio.sleep(0.05)

        beating = asyncio.ensure_future(heartbeats())
        try:
            tokens, _, usage = await generate(h, seed=7, max_tokens=3)
        finally:
            beating.cancel()
        assert tokens == {0: fake_tokens(7, 3)} and usage.migrations == 0

    run(test, progress_timeout_s=0.3, decode_stall_timeout_s=10.0)


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_calls_on_a_lost_node_give_up_at_once(step: str) -> None:
    """A node the registry marks stalled (or drops silent) is lost: a call waiting on it moves
    to another instance then, not at its deadline."""

    async def test(h: Harness) -> None:
        stuck = h.scripts(step)[0]  # a fresh balancer picks instance 0 first
        stuck.delay_s = 30.0

        async def lose_when_seen() -> None:
            await wait_for(lambda: bool(stuck.seen))
            instance = h.router.registry.get(f"{step}-0")
            assert instance is not None
            instance.lose()

        start = asyncio.get_running_loop().time()
        losing = asyncio.ensure_future(lose_when_seen())
        tokens, _, usage = await generate(h, seed=8, max_tokens=4)
        await losing
        assert asyncio.get_running_loop().time() - start < 5.0  # the deadline is 60 s
        assert tokens == {0: fake_tokens(8, 4)}
        assert (usage.retries, usage.migrations) == ((1, 0) if step == "prefill" else (0, 1))
        await wait_for(lambda: stuck.cancelled == stuck.seen)

    run(test, progress_timeout_s=60.0)


def test_stop_string_ends_the_request_and_aborts_the_decode() -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("decode"):
            script.delay_s = 0.02
        full = h.router.core.prompts.decode(fake_tokens(1, 40))
        stop = "here"
        assert stop in full
        tokens, text, _ = await generate(h, seed=1, max_tokens=40, stop=[stop])
        assert text == full[: full.index(stop)]
        assert len(tokens[0]) < 40
        decode = next(s for s in h.scripts("decode") if s.seen)
        await wait_for(lambda: decode.aborted == decode.seen)  # best-effort Abort sent
        assert decode.cancelled == decode.seen  # and the stream itself was cancelled

    run(test)


def test_closing_the_stream_aborts_upstream() -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("decode"):
            script.delay_s = 0.05
        spec = h.router.core.prepare(list(PROMPT), SamplingParams(max_tokens=50))
        deltas = h.router.core.run(spec, Usage(), "test")
        for _ in range(3):
            await anext(deltas)
        await deltas.aclose()  # what a client disconnect does
        decode = next(s for s in h.scripts("decode") if s.seen)
        await wait_for(lambda: bool(decode.cancelled) and bool(decode.aborted))
        assert h.router.core.inflight == 0
        assert all(i.inflight == 0 for i in h.router.registry.instances())

    run(test)


def test_n_samples_use_the_engine_child_seeds() -> None:
    async def test(h: Harness) -> None:
        tokens, _, usage = await generate(h, seed=9, n=3, max_tokens=5)
        assert tokens[0] == fake_tokens(9, 5)
        for index in (1, 2):
            assert tokens[index] == fake_tokens(child_seed(9, index), 5)
        assert usage.completion_tokens == 15 and usage.prompt_tokens == 5

    run(test)


def test_max_inflight_gives_429() -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("decode"):
            script.delay_s = 0.05
        spec = h.router.core.prepare(list(PROMPT), SamplingParams(max_tokens=40))
        busy = h.router.core.run(spec, Usage(), "test")
        await anext(busy)
        response = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 429
        assert response.json()["error"]["type"] == "rate_limit_error"
        await busy.aclose()
        response = await h.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
        assert response.status_code == 200

    run(test, max_inflight=1)


def test_metrics_and_slo_after_requests() -> None:
    async def test(h: Harness) -> None:
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
        assert (await h.http.post("/v1/completions", json=body)).status_code == 200
        assert (await h.http.post("/v1/completions", json={**body, "n": 99})).status_code == 400
        text = (await h.http.get("/metrics")).text
        assert 'pdserve_router_requests_total{endpoint="completions",status="ok"} 1.0' in text
        rejected = 'endpoint="completions",status="invalid_request_error"} 1.0'
        assert f"pdserve_router_requests_total{{{rejected}" in text
        assert "pdserve_router_ttft_seconds_count 1.0" in text
        assert "pdserve_router_itl_seconds_count 3.0" in text
        assert 'pdserve_router_instances{pool="decode",state="ready"} 2.0' in text
        report = (await h.http.get("/slo")).json()
        assert report["num_completed"] == 1 and report["slo"]["ttft_ms"] == 1000.0
        assert report["attainment"]["ttft"] == 1.0
        health = (await h.http.get("/health")).json()
        instances = {"prefill": 2, "decode": 2}
        assert health == {
            "status": "ok",
            "ready": True,
            "instances": instances,
            "prefill_fallback": True,
        }

    from bench.slo import SLOConfig

    run(test, slo=SLOConfig(ttft_ms=1000.0))


def test_static_instances_are_polled() -> None:
    async def test(h: Harness) -> None:
        from router.maintenance import poll_static

        registry = h.router.registry
        for instance in list(registry.instances()):
            registry.deregister(instance.instance_id)
        static = registry.add_static(Role.DECODE, h.decode[0].address)
        await poll_static(registry, h.router.clients, timeout_s=5.0)
        assert static.healthy and static.info == INFO  # asked once what it serves
        assert registry.max_model_len() == INFO.max_model_len
        await h.decode[0].stop()
        await poll_static(registry, h.router.clients, timeout_s=2.0)
        assert not static.healthy and registry.candidates(Role.DECODE) == []

    run(test)


def test_failure_after_the_first_token_over_http() -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("decode"):
            script.fail = "unavailable"
        body = {"prompt": [1, 2, 3], "max_tokens": 4}
        response = await h.http.post("/v1/completions", json={**body, "stream": True})
        assert response.status_code == 200  # the first token was already on its way
        events = [e for e in response.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert '"choices"' in events[0] and '"no_healthy_instance"' in events[-2]
        response = await h.http.post("/v1/completions", json=body)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "no_healthy_instance"

    run(test)
