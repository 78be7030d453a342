"""Malformed requests, table-driven, against an in-process router on fake nodes.

Every malformed HTTP request gets a 4xx with an OpenAI error body (naming the parameter when
one is at fault), every malformed gRPC ``Generate`` gets INVALID_ARGUMENT, and the router
stays healthy after each: ``/health`` answers and a good request completes. No request reaches
a node. The size limits are also checked on real uvicorn (a 50 MB body gets its 413).
"""

from __future__ import annotations

import asyncio
import json
import math
import socket
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from tests.router.inproc import Harness, running_router, serving_http

GOOD: dict[str, Any] = {"model": "tiny-llama", "prompt": [1, 400, 401], "max_tokens": 2}
CHAT: dict[str, Any] = {
    "model": "tiny-llama",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 2,
}
FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty")  # fmt: skip
INTS = ("max_tokens", "n", "top_k", "priority", "seed", "min_tokens", "logprobs")
# Out of range for each float field (a finite value the engine refuses).
FLOAT_OUT_OF_RANGE = {"temperature": -0.5, "top_p": 1.5, "min_p": 2.0,
                      "repetition_penalty": 0.0, "presence_penalty": 2.5,
                      "frequency_penalty": -3.0}  # fmt: skip


# 289 KB of schema: 21 s of compiling on a node's one grammar thread (issue 26, row 8)
BIG_ENUM = {"enum": [f"value-{i}" for i in range(20_000)]}
_INT_OUT_OF_RANGE = {"seed": ("-1", str(2**64), str(2**70))}


def _json_with(base: dict[str, Any], field: str, literal: str) -> bytes:
    """``base`` with ``field`` set to a raw JSON literal (NaN and Infinity are not JSON, but
    Python's and many clients' encoders write them)."""
    text = json.dumps({**base, field: "@@"})
    return text.replace('"@@"', literal).encode()


def _http_cases() -> list[tuple[str, str, bytes, int, str | None]]:
    """(name, path, body, status, param named in the error or None)."""
    cases: list[tuple[str, str, bytes, int, str | None]] = []
    for path, base in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT)):
        for field in FLOATS:
            for literal in ("NaN", "Infinity", "-Infinity", "1e400", "-1e400"):
                cases.append((f"{path} {field}={literal}", path, _json_with(base, field, literal),
                              400, field))  # fmt: skip
        for field, value in FLOAT_OUT_OF_RANGE.items():
            cases.append((f"{path} {field}={value}", path, _json_with(base, field, str(value)),
                          400, field))  # fmt: skip
        for field in (*FLOATS, *INTS):
            cases.append((f"{path} {field} string", path, _json_with(base, field, '"1"'),
                          400, field))  # fmt: skip
        for field in INTS:
            if not (field == "logprobs" and base is CHAT):  # chat's logprobs is a bool
                cases.append((f"{path} {field} bool", path, _json_with(base, field, "true"),
                              400, field))  # fmt: skip
            cases.append(
                (f"{path} {field} float", path, _json_with(base, field, "1.5"), 400, field)
            )
            for literal in _INT_OUT_OF_RANGE.get(field, (str(2**40), str(-(2**40)), str(2**70))):
                cases.append((f"{path} {field}={literal}", path,
                              _json_with(base, field, literal), 400, field))  # fmt: skip
    deep = 50_000
    cases += [
        ("deep array", "/v1/completions", b"[" * deep + b"]" * deep, 400, None),
        ("deep object", "/v1/completions", b'{"a":' * deep + b"1" + b"}" * deep, 400, None),
        (
            "deep prompt",
            "/v1/completions",
            b'{"prompt":' + b"[" * deep + b"]" * deep + b"}",
            400,
            None,
        ),
        (
            "deep chat tools",
            "/v1/chat/completions",
            _json_with(CHAT, "tools", "[" * 100 + "]" * 100),
            400,
            None,
        ),
        ("deep unclosed", "/v1/completions", b"[" * deep, 400, None),
        ("malformed json", "/v1/completions", b'{"prompt": [1, 2', 400, None),
        ("empty body", "/v1/completions", b"", 400, None),
        ("not an object", "/v1/completions", json.dumps([GOOD]).encode(), 400, None),
        ("invalid utf-8", "/v1/completions", b'{"prompt": "caf\xe9"}', 400, None),
        ("lone surrogate", "/v1/completions", b'{"prompt": "\\udc80"}', 400, "prompt"),
        (
            "prompt out of vocabulary",
            "/v1/completions",
            json.dumps({**GOOD, "prompt": [1, 2**40]}).encode(),
            400,
            "prompt",
        ),
        ("prompt NaN", "/v1/completions", _json_with(GOOD, "prompt", "[1, NaN]"), 400, "prompt.1"),
        (
            "stop id huge",
            "/v1/completions",
            json.dumps({**GOOD, "stop_token_ids": [2**40]}).encode(),
            400,
            "stop_token_ids",
        ),
        (
            "stop id NaN",
            "/v1/completions",
            _json_with(GOOD, "stop_token_ids", "[NaN]"),
            400,
            "stop_token_ids.0",
        ),
        (
            "logit_bias NaN",
            "/v1/completions",
            _json_with(GOOD, "logit_bias", '{"5": NaN}'),
            400,
            "logit_bias.5",
        ),
        (
            "max_tokens over context",
            "/v1/completions",
            json.dumps({**GOOD, "max_tokens": 100_000}).encode(),
            400,
            None,
        ),
        (
            "chat top_logprobs NaN",
            "/v1/chat/completions",
            _json_with({**CHAT, "logprobs": True}, "top_logprobs", "NaN"),
            400,
            "top_logprobs",
        ),
        # issue 26: over-long integers, huge prompt_logprobs, oversized prompts
        *[
            (f"{path} {field} of 5000 digits", path, _json_with(base, field, "9" * 5000), 400, None)
            for path, base in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT))
            for field in ("max_tokens", "seed", "prompt_logprobs")
        ],
        (
            "prompt id of 5000 digits",
            "/v1/completions",
            _json_with(GOOD, "prompt", f"[1, {'9' * 5000}]"),
            400,
            None,
        ),
        *[
            (
                f"{path} prompt_logprobs=1000000",
                path,
                _json_with(base, "prompt_logprobs", "1000000"),
                400,
                "prompt_logprobs",
            )
            for path, base in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT))
        ],
        (
            "echo logprobs=1000000",
            "/v1/completions",
            json.dumps({**GOOD, "echo": True, "logprobs": 1000000}).encode(),
            400,
            "logprobs",
        ),
        (
            "prompt text over context",
            "/v1/completions",
            json.dumps({**GOOD, "prompt": "a b " * 15_000}).encode(),
            400,
            "prompt",
        ),
        (
            "chat over context",
            "/v1/chat/completions",
            json.dumps(
                {**CHAT, "messages": [{"role": "user", "content": "a b " * 15_000}]}
            ).encode(),
            400,
            "prompt",
        ),
        (
            "prompt ids over context",
            "/v1/completions",
            json.dumps({**GOOD, "prompt": [5] * 5000}).encode(),
            400,
            "prompt",
        ),
        *[
            (
                f"{path} a 20,000-value enum schema",
                path,
                json.dumps({**base, "structured_outputs": {"json": BIG_ENUM}}).encode(),
                400,
                "structured_outputs",
            )
            for path, base in (("/v1/completions", GOOD), ("/v1/chat/completions", CHAT))
        ],
    ]
    return cases


HTTP_CASES = _http_cases()
MAX_BODY = 65536


def _check_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error


async def _still_healthy(h: Harness) -> None:
    assert (await h.http.get("/health")).status_code == 200
    response = await h.http.post("/v1/completions", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_http_table_has_every_case_of_the_issue() -> None:
    assert len(HTTP_CASES) >= 100
    names = {name for name, *_ in HTTP_CASES}
    for case in ("temperature=NaN", "temperature=Infinity", "repetition_penalty=NaN",
                 f"top_k={2**40}", f"priority={2**40}", f"priority={-(2**40)}"):  # fmt: skip
        assert f"/v1/completions {case}" in names


def test_malformed_http_requests() -> None:
    async def go() -> None:
        async with running_router() as h:
            headers = {"content-type": "application/json"}
            failed = []
            for name, path, body, status, param in HTTP_CASES:
                response = await h.http.post(path, content=body, headers=headers)
                try:
                    _check_error(response, status, param)
                except AssertionError:
                    failed.append(f"{name}: {response.status_code} {response.text[:200]}")
                await _still_healthy(h)
            assert not failed, "\n".join(failed)
            seen = [
                rid for role in ("prefill", "decode") for s in h.scripts(role) for rid in s.seen
            ]
            assert len(seen) == 2 * len(HTTP_CASES)  # the good requests only

    asyncio.run(go())


def _generate(**sampling: Any) -> pb.GenerateRequest:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 400, 401]))
    request.sampling_params.max_tokens = 2
    for name, value in sampling.items():
        if name in ("token_ids", "model", "text", "stop_token_ids", "structured_json"):
            continue
        setattr(request.sampling_params, name, value)
    if "token_ids" in sampling:
        request.token_ids.ids[:] = sampling["token_ids"]
    if "stop_token_ids" in sampling:
        request.sampling_params.stop_token_ids[:] = sampling["stop_token_ids"]
    if "structured_json" in sampling:
        request.sampling_params.structured_outputs.json = sampling["structured_json"]
    return request


GRPC_CASES: list[tuple[str, pb.GenerateRequest]] = [
    *[
        (f"{field}={value}", _generate(**{field: value}))
        for field in FLOATS
        for value in (math.nan, math.inf, -math.inf)
    ],
    *[
        (f"{field}={value}", _generate(**{field: value}))
        for field, value in FLOAT_OUT_OF_RANGE.items()
    ],
    ("max_tokens=0", _generate(max_tokens=0)),
    ("max_tokens over context", _generate(max_tokens=2**32 - 1)),
    ("min_tokens over max_tokens", _generate(min_tokens=2**32 - 1)),
    ("logprobs over cap", _generate(logprobs=2**32 - 1)),
    ("seed over 2**63", _generate(seed=2**64 - 1)),
    ("temperature over float32", _generate(temperature=1e39)),
    ("top_p=0", _generate(top_p=0.0)),
    ("prompt over context", _generate(token_ids=[5] * 5000)),
    ("token id out of vocabulary", _generate(token_ids=[1, 2**31 - 1])),
    ("negative token id", _generate(token_ids=[1, -(2**31)])),
    ("empty token ids", _generate(token_ids=[])),
    ("stop id out of vocabulary", _generate(stop_token_ids=[2**31 - 1])),
    ("no prompt", pb.GenerateRequest()),
    # issue 26: the poison request, and oversized prompts
    ("prompt_logprobs=1000000", _generate(prompt_logprobs=1_000_000)),
    ("prompt_logprobs over cap", _generate(prompt_logprobs=2**31 - 1)),
    ("text over context", pb.GenerateRequest(text="a b " * 15_000)),
    ("a 20,000-value enum schema", _generate(structured_json=json.dumps(BIG_ENUM))),
]


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded"])
def test_json_declared_as_something_else_is_refused(content_type: str) -> None:
    async def go() -> None:
        async with running_router() as h:
            body = json.dumps(GOOD).encode()
            response = await h.http.post(
                "/v1/completions", content=body, headers={"content-type": content_type}
            )
            _check_error(response, 415, None)
            await _still_healthy(h)
            for declared in ("application/json; charset=utf-8", "application/vnd.x+json"):
                ok = await h.http.post(
                    "/v1/completions", content=body, headers={"content-type": declared}
                )
                assert ok.status_code == 200, (declared, ok.text)

    asyncio.run(go())


RAW_GRPC = [  # bytes that are no valid protobuf of any type (a truncated field, a bad tag)
    b"\x0a\xff\xff\xff\xff\x0f",
    b"\xff" * 16,
    b"\x12\x05ab",
]


def test_undecodable_protobuf_is_invalid_argument() -> None:
    async def go() -> None:
        async with (
            running_router(grpc_server=True) as h,
            grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}") as channel,
        ):
            for method, kind in (
                ("Generate", channel.unary_stream),
                ("Register", channel.unary_unary),
                ("Heartbeat", channel.unary_unary),
            ):
                call = kind(f"/pdserve.v1.RouterService/{method}")
                for raw in RAW_GRPC:
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        reply = call(raw, timeout=30)
                        _ = [i async for i in reply] if method == "Generate" else await reply
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, raw)
                    assert "is not a valid" in (info.value.details() or "")
            stub = pb_grpc.RouterServiceStub(channel)
            items = [item async for item in stub.Generate(_generate(), timeout=30)]
            assert items[-1].finish_reason == pb.FINISH_REASON_LENGTH

    asyncio.run(go())


def test_malformed_grpc_generate() -> None:
    assert len(GRPC_CASES) >= 20

    async def go() -> None:
        async with running_router(grpc_server=True) as h:
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{h.grpc_port}")
            stub = pb_grpc.RouterServiceStub(channel)
            for name, request in GRPC_CASES:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    _ = [item async for item in stub.Generate(request, timeout=30)]
                    pytest.fail(f"{name}: accepted")
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value)
                assert info.value.details(), name
                items = [item async for item in stub.Generate(_generate(), timeout=30)]
                assert items[-1].finish_reason == pb.FINISH_REASON_LENGTH, name
            await channel.close()

    asyncio.run(go())


def _post_then_read(
    url: str, body: bytes, length: int | None = None, extra: str = ""
) -> httpx.Response:
    """POST ``body`` the simplest way (write it all, then read the answer), on a raw socket:
    httpx would read an early answer when a write fails, hiding a connection reset."""
    host, port = url.removeprefix("http://").split(":")
    length = len(body) if length is None else length
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {length}\r\nconnection: close\r\n{extra}\r\n")  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head.encode() + body)
        raw = b"".join(iter(lambda: sock.recv(65536), b""))
    status_line, _, rest = raw.partition(b"\r\n")
    _, _, content = rest.partition(b"\r\n\r\n")
    return httpx.Response(int(status_line.split()[1]), content=content)


def test_size_limits_on_real_uvicorn() -> None:
    """A 50 MB body, declared or chunked, gets a 413 with a JSON error (the server drains
    it first; answering and closing with the body unread would reset the connection)."""

    def chunks() -> Iterator[bytes]:
        for _ in range(50 * 16):
            yield b" " * 65536

    def client(url: str) -> None:  # in its own thread, writing as a separate client would
        _check_error(_post_then_read(url, b" " * (50 * 2**20)), 413, None)
        # Expect: 100-continue: answered at once, the body never sent (nothing to drain)
        waiting = _post_then_read(url, b"", 50 * 2**20, "expect: 100-continue\r\n")
        _check_error(waiting, 413, None)
        with httpx.Client(base_url=url, timeout=60) as http:
            chunked = http.post("/v1/completions", content=chunks())
            _check_error(chunked, 413, None)
            last = http.post("/v1/completions", content=iter([b" " * 60_000, b" " * 10_000]))
            _check_error(last, 413, None)  # over the limit with its last chunk: nothing to drain
            deep = http.post("/v1/completions", content=b"[" * 60_000)
            _check_error(deep, 400, None)
            good = http.post("/v1/completions", json=GOOD)
            assert good.status_code == 200, good.text

    async def go() -> None:
        async with running_router(max_body_bytes=MAX_BODY) as h, serving_http(h.router) as url:
            await asyncio.to_thread(client, url)

    asyncio.run(go())
