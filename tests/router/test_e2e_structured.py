"""Structured outputs through a real router and real prefill + decode nodes, with the official
``openai`` client: the prefill node samples the first token under the grammar, the decode node
continues it, and the text equals the offline (colocated) engine's for the same seeds. Bad specs
get a 400 and the server stays healthy."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import grpc
import httpx
import jsonschema
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from common.sampling_params import SamplingParams, StructuredOutputsParams
from tests.engine.test_structured_outputs import SCHEMA
from tests.router.conftest import Cluster, expected, wait_no_leaks
from tests.router.test_e2e_openai import client

PROMPT = "Give me JSON:"


@pytest.fixture(autouse=True)
def _no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


def _params(seed: int, max_tokens: int, **spec) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(
        temperature=0.8,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def test_twenty_seeded_json_requests(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    """The issue's "Show": 20 seeded requests, temperature 0.8; every ``stop`` validates, at
    least 18 stop, and the disaggregated text equals the offline engine's."""
    api = client(cluster)
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    wants = expected(offline, [PROMPT] * 20, [_params(s, 200, **spec) for s in range(20)])
    stops = 0
    for seed, [want] in enumerate(wants):
        out = api.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=200, temperature=0.8, seed=seed,
            extra_body={"structured_outputs": spec},
        ).choices[0]  # fmt: skip
        assert (out.text, out.finish_reason) == (want.text, want.finish_reason), seed
        if out.finish_reason == "stop":
            stops += 1
            jsonschema.validate(json.loads(out.text), SCHEMA)
    assert stops >= 18


def test_response_format_json_schema_and_chat(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    api = client(cluster)
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    wants = expected(offline, [PROMPT] * 3, [_params(s, 200, json=SCHEMA) for s in range(3)])
    for seed, [want] in enumerate(wants):
        out = api.completions.create(
            model="tiny-llama", prompt=PROMPT, max_tokens=200, temperature=0.8, seed=seed,
            extra_body={"response_format": fmt},
        ).choices[0]  # fmt: skip
        assert (out.text, out.finish_reason) == (want.text, want.finish_reason)
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    chat = api.chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=200, temperature=0.8, seed=1, response_format=fmt,  # type: ignore[arg-type]
    ).choices[0]  # fmt: skip
    if chat.finish_reason == "stop":
        jsonschema.validate(json.loads(chat.message.content or ""), SCHEMA)


def test_guided_regex_and_choice(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    api = client(cluster)
    regex, choices = r"[a-c]{2,5}-[0-9]{1,3}", ["yes", "no", "maybe so"]
    cases = [
        ({"guided_regex": regex}, {"regex": regex}),
        ({"guided_choice": choices}, {"choice": choices}),
    ]
    for body, spec in cases:
        wants = expected(offline, [PROMPT] * 3, [_params(s, 32, **spec) for s in range(3)])
        for seed, [want] in enumerate(wants):
            out = api.completions.create(
                model="tiny-llama", prompt=PROMPT, max_tokens=32, temperature=0.8, seed=seed,
                extra_body=body,
            ).choices[0]  # fmt: skip
            assert out.text == want.text and out.finish_reason == "stop"
            assert re.fullmatch(regex, out.text) if "regex" in spec else out.text in choices


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"structured_outputs": {"json": {"type": "nonsense"}}}, "nonsense"),
        ({"guided_regex": "a(b"}, "regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "missing"),
        ({"guided_json": "[1, 2]"}, "JSON object"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured output"),
        ({"response_format": {"type": "json_schema"}}, "schema is required"),
    ],
)
def test_bad_spec_is_a_400_and_the_server_stays_healthy(cluster: Cluster, extra, words) -> None:  # type: ignore[no-untyped-def]
    http = httpx.Client(base_url=cluster.router.base_url, timeout=120)
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 4, **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    assert http.get("/health").status_code == 200
    good = http.post("/v1/completions", json={**body, **{k: None for k in extra}})
    assert good.status_code == 200, good.text


def test_grpc_generate_carries_the_spec(cluster: Cluster, offline) -> None:  # type: ignore[no-untyped-def]
    params = _params(7, 32, regex=r"[0-9]{4}")
    [[want]] = expected(offline, [[1, 400, 401]], [params])

    async def go() -> tuple[list[int], grpc.StatusCode | None]:
        async with grpc.aio.insecure_channel(cluster.router.grpc_target) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            message = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 400, 401]))
            message.sampling_params.temperature = 0.8
            message.sampling_params.seed = 7
            message.sampling_params.max_tokens = 32
            message.sampling_params.structured_outputs.regex = r"[0-9]{4}"
            tokens = [t async for i in stub.Generate(message, timeout=180) for t in i.token_ids]
            message.sampling_params.structured_outputs.regex = "a(b"
            try:
                [_ async for _ in stub.Generate(message, timeout=180)]
            except grpc.aio.AioRpcError as e:
                return tokens, e.code()
            return tokens, None

    tokens, code = asyncio.run(go())
    assert tokens == want.token_ids
    assert code == grpc.StatusCode.INVALID_ARGUMENT
