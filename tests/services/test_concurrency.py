"""Many streams at once through both nodes: every one completes, whole and in order."""

from __future__ import annotations

import asyncio

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
from tests.services.nodes import Clients, Flow, Pair, Reference, random_prompts, run, wait_all_free

NUM_STREAMS = 64
MAX_TOKENS = 16


def test_64_concurrent_streams_complete(file_pair: Pair, reference: Reference) -> None:
    prompts = random_prompts([5 + (7 * i) % 56 for i in range(NUM_STREAMS)], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = reference.generate(prompts, [params] * NUM_STREAMS)

    async def go(clients: Clients) -> list[Flow]:
        wire = sampling_params_to_proto(params)
        flows = await asyncio.gather(
            *(clients.flow(f"many-{i}", p, wire, timeout_s=300) for i, p in enumerate(prompts))
        )
        await wait_all_free(clients)
        return list(flows)

    flows = run(go, file_pair)
    assert len(flows) == NUM_STREAMS
    for flow, (tokens, _) in zip(flows, expected):
        assert len(flow.tokens) == MAX_TOKENS
        finals = [m for m in flow.decode if m.finish_reason != pb.FINISH_REASON_UNSPECIFIED]
        assert finals == [flow.decode[-1]]
        assert flow.finish_reason == pb.FINISH_REASON_LENGTH
        assert flow.decode[-1].usage.completion_tokens == MAX_TOKENS
        assert flow.tokens == tokens
