"""Prompt → prefill node → decode node gives exactly the tokens of the offline engine (FileStore;
the Redis store is checked in test_redis_pair.py with the same cases); a request resumed on a
decode node with tokens already generated continues exactly; the prefill node reports a first
token that already ends the request."""

from __future__ import annotations

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
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


def test_decode_node_runs_a_request_whole(file_pair: Pair, reference: Reference) -> None:
    """No handle, no first token (the router's prefill fallback): the decode node prefills
    locally and streams every token, the first included — the offline engine's tokens, greedy
    and seeded (so the disaggregated run's too)."""
    prompts = random_prompts([29, 45], seed=64)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=65, max_tokens=12, ignore_eos=True),
    ]
    wants = reference.generate(prompts, params)

    async def go(clients: Clients) -> None:
        for i, (prompt, sp, (tokens, _)) in enumerate(zip(prompts, params, wants)):
            request = pb.DecodeRequest(
                request_id=f"whole-{i}",
                prompt_token_ids=prompt,
                sampling_params=sampling_params_to_proto(sp),
            )
            messages = [m async for m in clients.decode.Decode(request)]
            assert [t for m in messages for t in m.token_ids] == tokens
            assert messages[-1].usage.completion_tokens == len(tokens)
        await wait_all_free(clients)

    run(go, file_pair)


def test_prefill_reports_a_finishing_first_token(file_pair: Pair, reference: Reference) -> None:
    """The prefill reply says what happens next: HANDED_OFF (with the KV handle) when the
    request goes on, the engine's own finish when its first token ends it: an EOS/stop id,
    max_tokens == 1, or a context left full (no finish reason rewritten)."""
    prompt = random_prompts([20], seed=62)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    [(tokens, _)] = reference.generate([prompt], [greedy])
    full = random_prompts([511], seed=63)[0]  # max_model_len 512: room for one token
    cases = {
        "max_tokens 1": (prompt, dict(max_tokens=1), pb.FINISH_REASON_LENGTH),
        "stop id": (prompt, dict(stop_token_ids=[tokens[0]]), pb.FINISH_REASON_STOP),
        "goes on": (prompt, {}, pb.FINISH_REASON_HANDED_OFF),
        "context full": (full, dict(max_tokens=None, ignore_eos=True), pb.FINISH_REASON_LENGTH),
    }

    async def go(clients: Clients) -> None:
        for name, (ids, fields, reason) in cases.items():
            params = SamplingParams(**{**greedy.__dict__, **fields})
            request = pb.PrefillRequest(
                request_id=f"finish-{name}",
                prompt_token_ids=ids,
                sampling_params=sampling_params_to_proto(params),
            )
            reply = await clients.prefill.Prefill(request)
            assert reply.finish_reason == reason, name
            if ids is prompt:
                assert reply.first_token_id == tokens[0], name
            # The handle is the hand-off: only a request that goes on carries one.
            assert reply.HasField("kv_handle") == (reason == pb.FINISH_REASON_HANDED_OFF), name
            assert reply.timing.compute_ms > 0
            assert reply.HasField("stop_token_id") == (reason == pb.FINISH_REASON_STOP)
        await wait_all_free(clients)

    run(go, file_pair)


def test_a_handle_whose_entries_are_gone_is_recomputed(file_pair: Pair, reference: Reference):
    """The handle drives the decode-side load without asking the store first: entries evicted
    after the prefill are failed blocks, recomputed on the decode node; tokens are the same."""
    import shutil
    from pathlib import Path
    from urllib.parse import urlsplit

    prompt = random_prompts([50], seed=63)[0]
    params = SamplingParams(temperature=0.7, seed=64, max_tokens=8, ignore_eos=True)
    [(tokens, _)] = reference.generate([prompt], [params])
    wire = sampling_params_to_proto(params)

    async def go(clients: Clients) -> None:
        first = await clients.prefill.Prefill(
            pb.PrefillRequest(request_id="gone", prompt_token_ids=prompt, sampling_params=wire)
        )
        store_dir = Path(urlsplit(file_pair.store_url).path)
        for namespace in store_dir.iterdir():  # every entry of the prompt is gone
            shutil.rmtree(namespace)
        request = pb.DecodeRequest(
            request_id="gone",
            prompt_token_ids=prompt,
            output_token_ids=[first.first_token_id],
            kv_handle=first.kv_handle,
            sampling_params=wire,
        )
        messages = [m async for m in clients.decode.Decode(request)]
        assert [first.first_token_id] + [t for m in messages for t in m.token_ids] == tokens
        assert messages[0].kv_load.num_loaded_tokens == 0
        assert messages[0].kv_load.num_recomputed_tokens == len(prompt)
        await wait_all_free(clients)

    run(go, file_pair)
