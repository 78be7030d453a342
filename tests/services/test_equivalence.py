"""Prompt → prefill node → decode node gives exactly the tokens of the offline engine (FileStore;
the Redis store is checked in test_redis_pair.py with the same cases); a request resumed on a
decode node with tokens already generated continues exactly; the prefill node reports a first
token that already ends the request."""

from __future__ import annotations

from pdserve_proto import pdserve_pb2 as pb

from common.sampling_params import SamplingParams
from node_frontend.convert import sampling_params_to_proto
from tests.services.nodes import (
    Clients,
    Pair,
    Reference,
    check_equivalence,
    random_prompts,
    run,
    wait_all_free,
)


def test_file_store_matches_offline_engine(file_pair: Pair, reference: Reference) -> None:
    check_equivalence(file_pair, reference, seed=1, concurrency=4)


def test_resume_continues_exactly(file_pair: Pair, reference: Reference) -> None:
    """A decode node given the first k tokens (as after another decode node died) produces the
    rest of the offline output, seeded sampling included."""
    prompt = random_prompts([37], seed=60)[0]
    params = SamplingParams(temperature=0.9, top_k=40, seed=61, max_tokens=16, ignore_eos=True)
    [(tokens, _)] = reference.generate([prompt], [params])
    wire = sampling_params_to_proto(params)

    async def go(clients: Clients) -> None:
        first = await clients.prefill.Prefill(
            pb.PrefillRequest(request_id="resume", prompt_token_ids=prompt, sampling_params=wire)
        )
        assert first.first_token_id == tokens[0]
        request = pb.DecodeRequest(
            request_id="resume",
            prompt_token_ids=prompt,
            output_token_ids=tokens[:5],
            kv_handle=first.kv_handle,
            sampling_params=wire,
        )
        messages = [m async for m in clients.decode.Decode(request)]
        assert [t for m in messages for t in m.token_ids] == tokens[5:]
        assert messages[-1].usage.completion_tokens == len(tokens)
        await wait_all_free(clients)

    run(go, file_pair)


def test_prefill_reports_a_finishing_first_token(file_pair: Pair, reference: Reference) -> None:
    prompt = random_prompts([20], seed=62)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    [(tokens, _)] = reference.generate([prompt], [greedy])
    cases = {
        "max_tokens 1": (dict(max_tokens=1), pb.FINISH_REASON_LENGTH),
        "stop id": (dict(stop_token_ids=[tokens[0]]), pb.FINISH_REASON_STOP),
        "goes on": ({}, pb.FINISH_REASON_UNSPECIFIED),
    }

    async def go(clients: Clients) -> None:
        for name, (fields, reason) in cases.items():
            params = SamplingParams(**{**greedy.__dict__, **fields})
            request = pb.PrefillRequest(
                request_id=f"finish-{name}",
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(params),
            )
            reply = await clients.prefill.Prefill(request)
            assert (reply.first_token_id, reply.finish_reason) == (tokens[0], reason), name
            assert reply.HasField("kv_handle") and reply.timing.compute_ms > 0
            assert reply.HasField("stop_token_id") == (reason == pb.FINISH_REASON_STOP)

    run(go, file_pair)
