"""Request senders for ``pdserve bench``: one streamed request in, one RequestRecord out.

Two transports, same measurement rules:

- HTTP (OpenAI completions, SSE; ``bench.http_stream``, which stamps each event with the time
  its bytes were read). A chunk that carries a choice is one *token arrival* unless it
  is a pure terminator (empty text and a ``finish_reason``). A chunk with empty text and no
  finish reason still counts: the server generated a token whose bytes it is holding back
  (incomplete UTF-8). One chunk may carry several tokens, so token arrivals (the ITL samples)
  can be fewer than tokens; the completion token count comes from the final ``usage`` chunk
  (requested with ``stream_options.include_usage``), falling back to the number of arrivals.
- gRPC (``RouterService.Generate``). An item with ``token_ids`` is one arrival; the count comes
  from ``usage`` (falling back to the ids received).

Timing starts just before the request is sent (after any client-side concurrency limit, as vLLM
does) and ends when the stream ends (``[DONE]``, or its last item). Failures (HTTP status, transport errors, timeouts, error
events, an empty stream) are returned as failed records, never raised.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.http_stream import HttpStreamClient, HttpStreamError, StreamedResponse
from bench.slo import RequestRecord

logger = logging.getLogger(__name__)

# Log the detail of the first few failures; the report only counts them by kind.
_MAX_LOGGED_FAILURES = 3


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``prompt_len`` is 0 when unknown (text prompt): usage fills it in."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


Sender = Callable[[BenchRequest], Awaitable[RequestRecord]]


class _FailureLog:
    """Logs the detail of a sender's first few failures; the report only counts their kinds."""

    def __init__(self, limit: int = _MAX_LOGGED_FAILURES) -> None:
        self._left = limit

    def __call__(self, kind: str, detail: str) -> None:
        if self._left > 0:
            self._left -= 1
            logger.warning("request failed: %s %s", kind, detail[:300])


@dataclass
class _Timeline:
    """Arrival times of one streamed request, turned into a RequestRecord at the end."""

    request: BenchRequest
    log: _FailureLog
    start_s: float = field(default_factory=time.perf_counter)
    token_times_s: list[float] = field(default_factory=list)
    tokens_seen: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def arrival(self, now_s: float, num_tokens: int = 1) -> None:
        self.token_times_s.append(now_s)
        self.tokens_seen += num_tokens

    def usage(self, prompt_tokens: int | None, completion_tokens: int | None) -> None:
        self.prompt_tokens = prompt_tokens or self.prompt_tokens
        self.completion_tokens = completion_tokens or self.completion_tokens

    def finish(self, end_s: float | None = None) -> RequestRecord:
        if not self.token_times_s:
            return self.failure("empty stream", "the server closed the stream without a token")
        return RequestRecord(
            start_s=self.start_s,
            first_token_s=self.token_times_s[0],
            token_times_s=self.token_times_s,
            end_s=end_s or time.perf_counter(),
            prompt_tokens=self.prompt_tokens or self.request.prompt_len,
            output_tokens=max(self.completion_tokens or self.tokens_seen, 1),
            success=True,
        )

    def failure(self, kind: str, detail: str = "") -> RequestRecord:
        self.log(kind, detail)
        return RequestRecord(
            start_s=self.start_s,
            first_token_s=self.token_times_s[0] if self.token_times_s else None,
            token_times_s=self.token_times_s,
            end_s=time.perf_counter(),
            prompt_tokens=self.prompt_tokens or self.request.prompt_len,
            output_tokens=self.tokens_seen,
            success=False,
            error=kind,
        )


# --------------------------------------------------------------------------- HTTP


def completion_payload(model: str, request: BenchRequest) -> dict[str, Any]:
    """Body of a streamed /v1/completions request producing exactly ``output_len`` tokens."""
    return {
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,  # extension (vLLM, pdserve): keep going past EOS for fixed lengths
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _on_chunk(timeline: _Timeline, chunk: dict[str, Any], now_s: float) -> str | None:
    """Account one SSE chunk; return an error message if the chunk reports one."""
    if "error" in chunk:
        error = chunk["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    if usage := chunk.get("usage"):
        timeline.usage(usage.get("prompt_tokens"), usage.get("completion_tokens"))
    for choice in chunk.get("choices") or ():
        if choice.get("text") or choice.get("finish_reason") is None:
            timeline.arrival(now_s)
            break  # n == 1: one arrival per chunk
    return None


def _account(timeline: _Timeline, response: StreamedResponse) -> RequestRecord:
    """The record of a finished HTTP exchange, events at their arrival times."""
    if response.status == 401:  # every request will fail alike: say what fixes it
        return timeline.failure("HTTP 401", "the endpoint wants an API key: pass --api-key KEY")
    if response.status != 200:
        return timeline.failure(f"HTTP {response.status}", response.body.decode(errors="replace"))
    for arrival_s, data in response.events:
        if data == b"[DONE]":
            break
        error = _on_chunk(timeline, json.loads(data), arrival_s)
        if error is not None:
            return timeline.failure("error event", error)
    return timeline.finish(response.end_s)


async def send_http(
    client: HttpStreamClient, model: str, request: BenchRequest, log: _FailureLog | None = None
) -> RequestRecord:
    """Send one streamed completion and measure it; never raises for request failures."""
    timeline = _Timeline(request, log or _FailureLog())
    body = json.dumps(completion_payload(model, request)).encode()
    try:
        response = await client.post("/v1/completions", body, "application/json")
        return _account(timeline, response)
    except HttpStreamError as exc:  # refused, timed out, broken off
        return timeline.failure(exc.kind, str(exc))
    except (json.JSONDecodeError, AttributeError, TypeError) as exc:  # malformed chunk
        return timeline.failure("bad chunk", str(exc))


def _client(api_key: str | None, timeout_s: float) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        headers=headers,
        timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0)),
        trust_env=False,  # a proxy from the environment must not sit between bench and server
    )


async def fetch_first_model(base_url: str, api_key: str | None, timeout_s: float = 30.0) -> str:
    """The first model id listed by ``GET /v1/models``; raises RuntimeError if there is none."""
    try:
        async with _client(api_key, timeout_s) as client:
            response = await client.get(f"{base_url.rstrip('/')}/v1/models")
            if response.status_code == 401:
                hint = "pass --api-key KEY" if api_key is None else "--api-key was refused"
                raise RuntimeError(f"{base_url} wants an API key (HTTP 401): {hint}")
            response.raise_for_status()
            models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise RuntimeError(f"cannot list models at {base_url}: {exc}") from exc
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


@asynccontextmanager
async def open_http_sender(
    base_url: str, model: str, api_key: str | None = None, timeout_s: float = 600.0
) -> AsyncIterator[Sender]:
    """A Sender over one pool of HTTP connections (one per request in flight), closed on exit.
    ``timeout_s`` bounds each request; ValueError for a URL that is not http(s)."""
    log = _FailureLog()
    headers = [("Authorization", f"Bearer {api_key}")] if api_key else []
    client = HttpStreamClient(base_url, headers, timeout_s)
    try:

        async def send(request: BenchRequest) -> RequestRecord:
            return await send_http(client, model, request, log)

        yield send
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- gRPC


@asynccontextmanager
async def open_grpc_sender(
    target: str, model: str, timeout_s: float = 600.0
) -> AsyncIterator[Sender]:
    """A Sender driving ``RouterService.Generate`` at ``target`` (host:port), closed on exit."""
    # Imported here so the HTTP path works without the generated modules on the path.
    import grpc
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto import pdserve_pb2_grpc as pb_grpc

    log = _FailureLog()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.RouterServiceStub(channel)

        async def send(request: BenchRequest) -> RequestRecord:
            timeline = _Timeline(request, log)
            try:
                return await _stream_generate(stub, pb, model, request, timeline, timeout_s)
            except grpc.aio.AioRpcError as exc:
                return timeline.failure(f"gRPC {exc.code().name}", exc.details() or "")

        yield send


async def _stream_generate(
    stub: Any, pb: Any, model: str, request: BenchRequest, timeline: _Timeline, timeout_s: float
) -> RequestRecord:
    params = pb.SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)
    message = pb.GenerateRequest(model=model, sampling_params=params)
    if isinstance(request.prompt, str):
        message.text = request.prompt
    else:
        message.token_ids.ids.extend(request.prompt)
    async for item in stub.Generate(message, timeout=timeout_s):
        if item.token_ids:
            timeline.arrival(time.perf_counter(), len(item.token_ids))
        if item.HasField("usage"):
            timeline.usage(item.usage.prompt_tokens, item.usage.completion_tokens)
        if item.finish_reason in (pb.FINISH_REASON_ERROR, pb.FINISH_REASON_ABORT):
            kind = pb.FinishReason.Name(item.finish_reason).removeprefix("FINISH_REASON_").lower()
            return timeline.failure(kind, item.error_message)
    return timeline.finish()
