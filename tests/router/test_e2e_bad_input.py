"""Bad input and API keys against a real router process (real uvicorn, real nodes).

Each bad request gets a 4xx with an OpenAI error body, and a good request right after it
succeeds: the server stays healthy. The keyed router requires the key everywhere but /health.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import openai
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from tests.router.conftest import API_KEY, Cluster, RouterProcess, wait_no_leaks

GOOD = {"model": "tiny-llama", "prompt": [1, 400, 401], "max_tokens": 2}
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _chunks(total: int) -> Iterator[bytes]:
    for _ in range(total // 8192):
        yield b" " * 8192


# (name, request kwargs for httpx, expected status, checks the OpenAI error body). Headers far
# over the limit may be refused by uvicorn's h11 parser (a plain 400) before our guard (431).
CASES: list[tuple[str, dict[str, Any], int | tuple[int, ...], bool]] = [
    ("malformed json", {"content": b'{"prompt": [1, 2'}, 400, True),
    ("not an object", {"json": [GOOD]}, 400, True),
    ("wrong type", {"json": {**GOOD, "max_tokens": "two"}}, 400, True),
    ("bool as int", {"json": {**GOOD, "n": True}}, 400, True),
    ("unknown model", {"json": {**GOOD, "model": "gpt-17"}}, 404, True),
    ("n over cap", {"json": {**GOOD, "n": 5}}, 400, True),
    ("max_tokens over context", {"json": {**GOOD, "max_tokens": 100_000}}, 400, True),
    ("logprobs over cap", {"json": {**GOOD, "logprobs": 6}}, 400, True),
    ("invalid utf-8", {"content": b'{"prompt": "caf\xe9", "max_tokens": 2}'}, 400, True),
    ("lone surrogate", {"content": b'{"prompt": "\\udc80", "max_tokens": 2}'}, 400, True),
    ("token id out of vocabulary", {"json": {**GOOD, "prompt": [1, 999_999]}}, 400, True),
    ("negative token id", {"json": {**GOOD, "prompt": [1, -4]}}, 400, True),
    ("empty prompt", {"json": {**GOOD, "prompt": []}}, 400, True),
    ("prompt over context", {"json": {**GOOD, "prompt": [5] * 600}}, 400, True),
    ("bad temperature", {"json": {**GOOD, "temperature": -1}}, 400, True),
    ("oversized body", {"content": b" " * 70_000}, 413, True),
    ("oversized chunked body", {"content": _chunks(80_000)}, 413, True),
    ("oversized headers", {"json": GOOD, "headers": {"x-pad": "a" * 9000}}, 431, True),
    ("huge headers", {"json": GOOD, "headers": {"x-pad": "a" * 200_000}}, (400, 431), False),
]
CHAT_CASES: list[tuple[str, dict[str, Any], int]] = [
    ("no messages", {**CHAT, "messages": []}, 400),
    ("bad role", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400),
    ("content type", {**CHAT, "messages": [{"role": "user", "content": 7}]}, 400),
    ("top_logprobs over cap", {**CHAT, "logprobs": True, "top_logprobs": 9}, 400),
    ("n over cap", {**CHAT, "n": 9}, 400),
]


@pytest.fixture(autouse=True)
def _no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


def _assert_openai_error(response: httpx.Response) -> None:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def _good_request_works(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_bad_completions_then_good(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router.base_url, timeout=120) as http:
        for name, kwargs, status, openai_body in CASES:
            response = http.post("/v1/completions", **kwargs)
            allowed = status if isinstance(status, tuple) else (status,)
            assert response.status_code in allowed, (name, response.text)
            if openai_body or response.status_code == 431:
                _assert_openai_error(response)
            _good_request_works(http)


def test_bad_chats_and_routes_then_good(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.router.base_url, timeout=120) as http:
        for name, body, status in CHAT_CASES:
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == status, (name, response.text)
            _assert_openai_error(response)
            _good_request_works(http)
        for method, path, status in [("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405)]:
            response = http.request(method, path)
            assert response.status_code == status
            _assert_openai_error(response)
        assert http.post("/v1/chat/completions", json=CHAT).status_code == 200


ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", GOOD),
    ("POST", "/v1/chat/completions", CHAT),
    ("GET", "/metrics", None),
    ("GET", "/slo", None),
]


def test_api_key_on_every_route_but_health(keyed_router: RouterProcess) -> None:
    with httpx.Client(base_url=keyed_router.base_url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        for method, path, body in [*ROUTES, ("GET", "/v1/unknown", None)]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
                response = http.request(method, path, json=body, headers=headers)
                assert response.status_code == 401, (path, headers)
                _assert_openai_error(response)
        for method, path, body in ROUTES:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            response = http.request(method, path, json=body, headers=headers)
            assert response.status_code == 200, (path, response.text)
    api = openai.OpenAI(base_url=f"{keyed_router.base_url}/v1", api_key=API_KEY, max_retries=0)
    assert api.completions.create(model="tiny-llama", prompt=[1, 5], max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed_router.base_url}/v1", api_key="nope", max_retries=0)\
            .models.list()  # fmt: skip


def test_api_key_on_grpc_generate(keyed_router: RouterProcess) -> None:
    async def go() -> None:
        async with grpc.aio.insecure_channel(keyed_router.grpc_target) as channel:
            stub = pb_grpc.RouterServiceStub(channel)
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 400, 401]))
            request.sampling_params.max_tokens = 2
            with pytest.raises(grpc.aio.AioRpcError) as info:
                _ = [i async for i in stub.Generate(request, timeout=60)]
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            metadata = (("authorization", f"Bearer {API_KEY}"),)
            items = [i async for i in stub.Generate(request, timeout=120, metadata=metadata)]
            assert sum(len(i.token_ids) for i in items) == 2

    asyncio.run(go())
