"""Beam search through the router: the prompt prefilled once, the beams decoded on one node.

NOTE on the rounds. The search is the offline ``LLM.beam_search``'s (``common/beam_search.py``:
HF's scores, candidates and stopping rule); only where each round runs differs. Round 1's
candidates are the top-K logprobs of the prefill node's first position: a two-token request,
so that the node hands the prompt's KV to the store (a one-token search ends there, and hands
nothing off). Every later round sends each running beam to one decode node as the prompt with
the beam's tokens as outputs already known and one more token to sample greedily, with the
top-K logprobs of that position. The first decode round carries the prefill's KV handle, so the
node loads the prompt's blocks once; every beam after that hits them, and the blocks its
parent's request filled the round before, in the node's prefix cache. A round therefore
computes at most one block's worth of tokens per beam, and the beams share their prefix. A beam
that drops out holds nothing: its request ended with its round.

A round that fails on its node (a transport fault, the node giving up or going silent) runs
again, whole, on another decode node without the handle (that node computes the prompt): a fault
costs time, never a different result. The request's own faults (a 400 from a node) end it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import finish_reason_from_proto

from common.beam_search import BeamSearch, TopLogprobs
from common.sampling_params import SamplingParams
from router.registry import Instance, Role
from router.sample import SampleDelta, SampleState, to_proto_sampling

if TYPE_CHECKING:
    from router.flow import GenerateSpec, RequestFlow, Usage


async def beam_search(
    flow: RequestFlow, spec: GenerateSpec, usage: Usage
) -> AsyncGenerator[SampleDelta, None]:
    """The ``spec.params.n`` best hypotheses of ``spec.beam``'s search, best first, one
    finished delta each (indices 0..n-1). Raises RouterError."""
    assert spec.beam is not None
    search = BeamSearch(
        spec.prompt_token_ids, spec.beam, flow.eos_token_ids, spec.params.max_tokens or 1
    )
    k = search.num_logprobs
    handle: pb.KVHandle | None = None
    first = _round_sampling(1 if search.max_tokens == 1 else 2, k)
    prompt = flow.prompt_info(spec.prompt_token_ids, spec.lora_name)
    response = await flow._prefill_or_fallback(spec, 0, first, prompt, usage)
    if response is not None:  # else no prefill path: round 1 runs on the decode node too
        usage.cached_tokens = response.num_cached_tokens
        if not response.HasField("first_logprob"):
            raise RuntimeError("the prefill node sent no logprobs though they were asked for")
        search.advance([_top(response.first_logprob)])
        handle = response.kv_handle if response.HasField("kv_handle") else None
    rounds = _DecodeRounds(flow, spec, usage, k)
    while not search.done:
        outputs = [beam[len(spec.prompt_token_ids) :] for beam in search.beams()]
        search.advance(await rounds.run(outputs, handle))
        handle = None  # loaded once: later rounds hit the node's prefix cache
    for index, seq in enumerate(search.sequences()[: spec.params.n]):
        state = SampleState(index, flow.tokenizer, spec.prompt_token_ids, spec.params)
        usage.completion_tokens += len(seq.output_token_ids)
        yield state.push(seq.output_token_ids, (), seq.finish_reason)


def _round_sampling(max_tokens: int, k: int) -> pb.SamplingParams:
    """One more token, greedy, with the top ``k`` alternatives of its position; ``max_tokens``
    counts the beam's tokens already known (sent as outputs)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=k, ignore_eos=True)
    return to_proto_sampling(params, 0)


def _top(logprob: pb.TokenLogprob) -> TopLogprobs:
    return TopLogprobs(list(logprob.top_token_ids), list(logprob.top_logprobs))


class _DecodeRounds:
    """The decode rounds of one search, pinned to one decode instance while it serves them."""

    def __init__(self, flow: RequestFlow, spec: GenerateSpec, usage: Usage, k: int) -> None:
        self.flow, self.spec, self.usage, self.k = flow, spec, usage, k
        self.instance: Instance | None = None
        self.tried: set[str] = set()
        self.calls = 0  # node-side request ids stay unique

    async def run(self, outputs: list[list[int]], handle: pb.KVHandle | None) -> list[TopLogprobs]:
        """Each beam's next-token candidates (in ``outputs`` order), from one decode node;
        another node reruns the whole round when that one fails. Raises RouterError."""
        from router.flow import DECODE_FAILURES, DecodeAttempts

        attempts = DecodeAttempts(self.flow, self.spec, self.usage, self.tried)
        while (instance := attempts.next(pinned=self.instance)) is not None:
            self.instance = instance
            try:
                calls = [self._score(instance, i, out, handle) for i, out in enumerate(outputs)]
                results = await asyncio.gather(*calls, return_exceptions=True)
                errors = [r for r in results if isinstance(r, BaseException)]
                if errors:
                    raise errors[0]
                return results  # type: ignore[return-value]
            except (*DECODE_FAILURES, asyncio.TimeoutError) as exc:
                attempts.failed(instance, exc)
            self.instance, handle = None, None  # the next node computes the prompt itself
        raise attempts.exhausted()

    async def _score(
        self, instance: Instance, beam: int, output: list[int], handle: pb.KVHandle | None
    ) -> TopLogprobs:
        from router.flow import _NodeGaveUp

        flow = self.flow
        self.calls += 1
        request = pb.DecodeRequest(
            request_id=self.spec.upstream_id(beam, f"b{self.calls}"),
            prompt_token_ids=self.spec.prompt_token_ids,
            output_token_ids=output,
            kv_handle=handle,
            sampling_params=_round_sampling(len(output) + 1, self.k),
            priority=self.spec.priority,
            lora_name=self.spec.lora_name,
        )
        call = flow.clients.decode(instance.address).Decode(request)

        async def last_candidates() -> TopLogprobs:
            top = None
            async for item in call:
                if item.logprobs:
                    top = _top(item.logprobs[-1])
                if finish_reason_from_proto(item.finish_reason) in ("abort", "error"):
                    raise _NodeGaveUp(item.error_message or "aborted by the node")
            if top is None:
                raise _NodeGaveUp("the stream ended with no logprobs")
            return top

        done = False
        with flow.registry.track(instance):
            try:
                top = await asyncio.wait_for(last_candidates(), flow.config.prefill_timeout_s)
                done = True
                return top
            finally:
                if not done:  # failed, timed out or cancelled: the node stops it too
                    call.cancel()
                    flow._abort_later(instance, request.request_id, Role.DECODE)
