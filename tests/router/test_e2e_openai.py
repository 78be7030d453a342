"""End to end through a real router and real nodes: the official ``openai`` client (and gRPC
Generate) get exactly the offline engine's output; client disconnects free every block.

Every test ends with all KV blocks free on every node (``wait_no_leaks``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from common.sampling_params import SamplingParams
from tests.router.conftest import Cluster, expected, wait_no_leaks

MODEL = "tiny-llama"
TEXT_PROMPT = "Once upon a time, in a small village by the sea,"
IDS_PROMPT = [1, *range(400, 440)]  # 41 tokens: two full blocks and a partial one
MAX_TOKENS = 12
SAMPLING = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "top_p": 0.9, "seed": 1234},
}


@pytest.fixture(autouse=True)
def _no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


def client(cluster: Cluster, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.router.base_url}/v1", api_key=api_key, max_retries=0, timeout=180
    )


@pytest.mark.parametrize("mode", sorted(SAMPLING))
@pytest.mark.parametrize("prompt", [TEXT_PROMPT, IDS_PROMPT], ids=["text", "ids"])
def test_completions_match_offline(cluster: Cluster, offline, mode: str, prompt) -> None:  # type: ignore[no-untyped-def]
    params = SAMPLING[mode]
    [[want]] = expected(offline, [prompt], [SamplingParams(max_tokens=MAX_TOKENS, **params)])
    api = client(cluster)
    result = api.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, **params)
    choice = result.choices[0]
    assert (choice.text, choice.finish_reason) == (want.text, want.finish_reason)
    assert result.usage is not None and result.usage.completion_tokens == len(want.token_ids)

    chunks = list(
        api.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True}, **params,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        want.token_ids
    )


@pytest.mark.parametrize("mode", sorted(SAMPLING))
def test_chat_matches_offline(cluster: Cluster, offline, mode: str) -> None:  # type: ignore[no-untyped-def]
    params = SAMPLING[mode]
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the weather."},
    ]
    rendered = offline.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = offline.tokenizer.encode(rendered, add_special_tokens=False)
    [[want]] = expected(offline, [prompt_ids], [SamplingParams(max_tokens=MAX_TOKENS, **params)])
    api = client(cluster)
    result = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, **params
    )
    assert result.choices[0].message.content == want.text
    assert result.choices[0].finish_reason == want.finish_reason
    assert result.usage is not None and result.usage.prompt_tokens == len(prompt_ids)
    stream = api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, stream=True, **params
    )
    chunks = [c for c in stream if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text


def test_n_stop_strings_and_extras_match_offline(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    api = client(cluster)
    extras = {"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 3}
    sampled = SamplingParams(n=3, temperature=0.9, seed=77, max_tokens=10, **extras)
    [wants] = expected(offline, [IDS_PROMPT], [sampled])
    result = api.completions.create(
        model=MODEL, prompt=IDS_PROMPT, n=3, temperature=0.9, seed=77, max_tokens=10,
        extra_body=extras,
    )  # fmt: skip
    got = sorted(result.choices, key=lambda c: c.index)
    assert [c.text for c in got] == [w.text for w in wants]
    # A stop string from the middle of the greedy output: the router must cut there.
    [[greedy]] = expected(offline, [IDS_PROMPT], [SamplingParams(temperature=0, max_tokens=24)])
    stop = next(greedy.text[i : i + 3] for i in range(4, 20) if greedy.text[i : i + 3].strip())
    [[want]] = expected(
        offline, [IDS_PROMPT], [SamplingParams(temperature=0, max_tokens=24, stop=[stop])]
    )
    result = api.completions.create(
        model=MODEL, prompt=IDS_PROMPT, temperature=0, max_tokens=24, stop=[stop]
    )
    assert (result.choices[0].text, result.choices[0].finish_reason) == (want.text, "stop")


def test_grpc_generate_gives_offline_token_ids(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    cases = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=99, max_tokens=16)]  # fmt: skip
    wants = expected(offline, [IDS_PROMPT] * 2, cases)

    async def go() -> list[list[int]]:
        async with grpc.aio.insecure_channel(cluster.router.grpc_target) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            outs = []
            for params in cases:
                message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=IDS_PROMPT))
                message.sampling_params.temperature = params.temperature
                message.sampling_params.max_tokens = params.max_tokens or 0
                message.sampling_params.ignore_eos = params.ignore_eos
                if params.seed is not None:
                    message.sampling_params.seed = params.seed
                items = [i async for i in stub.Generate(message, timeout=180)]
                outs.append([t for i in items for t in i.token_ids])
            return outs

    got = asyncio.run(go())
    assert got == [w[0].token_ids for w in wants]


def test_grpc_generate_returns_prompt_logprobs(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    """The first stream item carries the prompt tokens' logprobs, as the offline engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    (want,) = offline.generate([IDS_PROMPT], params, use_tqdm=False)

    async def go() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(cluster.router.grpc_target) as channel:
            message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=IDS_PROMPT))
            message.sampling_params.temperature = 0.0
            message.sampling_params.max_tokens = 2
            message.sampling_params.prompt_logprobs = 2
            stub = pb_grpc.RouterServiceStub(channel)
            return [i async for i in stub.Generate(message, timeout=180)]

    items = asyncio.run(go())
    assert items[0].HasField("prompt_logprobs")
    assert not any(i.HasField("prompt_logprobs") for i in items[1:])
    got = items[0].prompt_logprobs.tokens
    assert [t.token_id for t in got] == IDS_PROMPT[1:]
    for token, ref in zip(got, want.prompt_logprobs[1:]):
        assert list(token.top_token_ids) == ref.top_ids
        assert abs(token.logprob - ref.logprob) < 1e-4


def test_client_disconnect_aborts_upstream(cluster: Cluster) -> None:
    body = {"model": MODEL, "prompt": IDS_PROMPT, "max_tokens": 400, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with (
        httpx.Client(timeout=180) as http,
        http.stream("POST", f"{cluster.router.base_url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        received = [line for line in (next(lines) for _ in range(6)) if line]
        assert received  # tokens are flowing; now go away mid-stream
    # The router records the abort (and _no_leaks checks every node freed the blocks).
    deadline = time.monotonic() + 60
    while 'status="aborted"' not in httpx.get(f"{cluster.router.base_url}/metrics").text:
        assert time.monotonic() < deadline, "the router never saw the disconnect"
        time.sleep(0.2)


def test_slo_and_metrics_report_the_traffic(cluster: Cluster) -> None:
    base = cluster.router.base_url
    report = httpx.get(f"{base}/slo", timeout=30).json()
    assert report["schema"] == "pdserve.slo_report/v1" and report["num_completed"] >= 1
    assert report["ttft"]["count"] >= 1 and report["slo"]["ttft_ms"] == 60000.0
    assert "| TTFT |" in httpx.get(f"{base}/slo", params={"format": "markdown"}).text
    metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert 'pdserve_router_instances{pool="prefill",state="ready"} 2.0' in metrics
    assert "pdserve_router_ttft_seconds_bucket" in metrics
    assert "pdserve_router_e2e_seconds_count" in metrics
