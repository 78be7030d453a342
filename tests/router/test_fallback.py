"""Prefill fallback and readiness, on fake nodes.

With no prefill path (no healthy prefill instance, or every prefill attempt failed before a
first token) a decode node runs the request whole: no handle, no first token. The fake model
is a function of (seed, position), as the engine's per-position seeds make the real one, so
the tokens must be exactly the disaggregated run's. ``/ready`` is 503 until a prefill path and
a decode instance are there; ``/health`` is always 200.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from router.errors import RouterError
from tests.router.fakes import fake_tokens
from tests.router.inproc import Harness, running_router
from tests.router.test_flow import generate


def run(test: Callable[[Harness], Awaitable[None]], **kwargs: Any) -> None:
    async def main() -> None:
        async with running_router(**kwargs) as harness:
            await test(harness)

    asyncio.run(main())


async def fallbacks(h: Harness) -> dict[str, float]:
    text = (await h.http.get("/metrics")).text
    pattern = r'^pdserve_router_prefill_fallbacks_total\{reason="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.MULTILINE)}


def _decode_requests(h: Harness) -> list[Any]:
    return [r for s in h.scripts("decode") for r in s.requests]


def test_no_prefill_instance_falls_back_to_decode() -> None:
    async def test(h: Harness) -> None:
        tokens, _, usage = await generate(h, seed=11, max_tokens=7)
        assert tokens == {0: fake_tokens(11, 7)}  # what prefill + decode would have made
        assert usage.completion_tokens == 7
        (request,) = _decode_requests(h)
        assert not request.output_token_ids and not request.HasField("kv_handle")
        tokens, _, _ = await generate(h, seed=12, max_tokens=5, temperature=0.8, n=2)
        assert tokens[0] == fake_tokens(12, 5) and len(tokens[1]) == 5
        assert await fallbacks(h) == {"no_prefill": 3.0}
        body = {"prompt": [1, 2, 3], "max_tokens": 4, "seed": 5}
        for stream in (False, True):
            response = await h.http.post("/v1/completions", json={**body, "stream": stream})
            assert response.status_code == 200, response.text

    run(test, num_prefill=0)


def test_prefill_failing_everywhere_falls_back() -> None:
    async def test(h: Harness) -> None:
        for script in h.scripts("prefill"):
            script.fail = "unavailable"
        tokens, _, usage = await generate(h, seed=4, max_tokens=6)
        assert tokens == {0: fake_tokens(4, 6)}
        assert usage.retries == 2  # both prefill instances tried first
        assert await fallbacks(h) == {"prefill_failed": 1.0}

    run(test)


def test_no_fallback_when_turned_off_or_busy() -> None:
    async def off(h: Harness) -> None:
        with pytest.raises(RouterError) as info:
            await generate(h, max_tokens=4)
        assert info.value.status == 503 and not _decode_requests(h)

    async def busy(h: Harness) -> None:
        for script in h.scripts("prefill"):
            script.fail = "busy"
        with pytest.raises(RouterError) as info:
            await generate(h, max_tokens=4)
        assert info.value.status == 429 and not _decode_requests(h)  # full is not broken

    run(off, num_prefill=0, prefill_fallback=False)
    run(busy)


@pytest.mark.parametrize(
    ("num_prefill", "num_decode", "fallback", "ready"),
    [(0, 0, True, False), (1, 0, True, False), (0, 1, True, True), (0, 1, False, False),
     (1, 1, False, True), (2, 2, True, True)],
)  # fmt: skip
def test_ready_needs_a_prefill_path_and_a_decode(
    num_prefill: int, num_decode: int, fallback: bool, ready: bool
) -> None:
    async def test(h: Harness) -> None:
        response = await h.http.get("/ready")
        assert response.status_code == (200 if ready else 503)
        assert response.json() == {
            "status": "ready" if ready else "not_ready",
            "ready": ready,
            "instances": {"prefill": num_prefill, "decode": num_decode},
            "prefill_fallback": fallback,
        }
        health = await h.http.get("/health")
        assert health.status_code == 200 and health.json()["ready"] is ready

    run(test, num_prefill=num_prefill, num_decode=num_decode, prefill_fallback=fallback)


def test_ready_and_health_need_no_api_key() -> None:
    async def test(h: Harness) -> None:
        h.http.headers.pop("Authorization")
        assert (await h.http.get("/ready")).status_code == 200
        assert (await h.http.get("/health")).status_code == 200
        assert (await h.http.get("/metrics")).status_code == 401

    run(test, api_key="k")
