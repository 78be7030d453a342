"""Beam search's rounds against fake nodes (``router/beams.py``): one prefill, every round on one
decode node, and a failed round rerun whole on another node with the same result.

The fake model's logprobs are flat (every candidate -2.0, ids 3, 4, …), so the search ranks its
ties by (beam, token id): a fixed, known answer whichever node computes a round."""

from __future__ import annotations

import asyncio
from typing import Any

from common.sampling_params import SamplingParams
from router.flow import Usage
from tests.router.inproc import Harness, running_router

PROMPT = [1, 300, 301, 302, 303]


async def beam_search(h: Harness, width: int, n: int, max_tokens: int) -> tuple[Any, Usage]:
    params = SamplingParams(n=n, temperature=0.0, max_tokens=max_tokens)
    spec = h.router.core.prepare(list(PROMPT), params, beam=(width, 1.0))
    usage = Usage()
    deltas = [d async for d in h.router.core.run(spec, usage, "test")]
    return [(d.index, d.token_ids, d.finish_reason) for d in deltas], usage


def run(test, **kwargs: Any) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with running_router(**kwargs) as harness:
            await test(harness)

    asyncio.run(main())


def test_one_prefill_then_every_round_on_one_decode_node() -> None:
    async def test(h: Harness) -> None:
        got, usage = await beam_search(h, width=2, n=2, max_tokens=4)
        # flat logprobs: the best beams take the lowest ids, beam 0 first
        assert got == [(0, [3, 3, 3, 3], "length"), (1, [3, 3, 3, 4], "length")]
        assert usage.completion_tokens == 8 and usage.migrations == 0
        prefills = [r for s in h.scripts("prefill") for r in s.requests]
        assert len(prefills) == 1 and prefills[0].sampling_params.max_tokens == 2
        used = [s for s in h.scripts("decode") if s.requests]
        assert len(used) == 1  # pinned: the beams' shared blocks are on that node
        requests = used[0].requests
        assert len(requests) == 3 * 2  # rounds 2..4, two beams each
        for r in requests:  # one more token each, greedy, K = 2 * width candidates
            assert r.sampling_params.max_tokens == len(r.output_token_ids) + 1
            assert r.sampling_params.logprobs == 4 and r.sampling_params.temperature == 0.0
        with_handle = [r for r in requests if r.HasField("kv_handle")]
        assert with_handle == requests[:2]  # the first decode round loads the prompt's KV

    run(test)


def test_a_failed_round_reruns_whole_on_another_node_with_the_same_result() -> None:
    async def test(h: Harness) -> None:
        first, second = h.scripts("decode")
        first.die_after = 0  # decode-0 (a fresh balancer's first pick) resets every stream
        got, usage = await beam_search(h, width=2, n=2, max_tokens=4)
        assert got == [(0, [3, 3, 3, 3], "length"), (1, [3, 3, 3, 4], "length")]  # as clean
        assert usage.migrations == 1 and first.requests
        rerun = second.requests
        assert len(rerun) == 3 * 2  # every round, the first one again in full
        assert not any(r.HasField("kv_handle") for r in rerun)  # it computes the prompt

    run(test)


def test_a_one_token_search_is_the_prefills_alone() -> None:
    async def test(h: Harness) -> None:
        got, _ = await beam_search(h, width=3, n=2, max_tokens=1)
        assert got == [(0, [3], "length"), (1, [4], "length")]
        prefills = [r for s in h.scripts("prefill") for r in s.requests]
        assert [r.sampling_params.max_tokens for r in prefills] == [1]  # nothing handed off
        assert not any(s.requests for s in h.scripts("decode"))

    run(test)
