"""The OpenAI-compatible HTTP front door (FastAPI), sharing the event loop with gRPC.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models``, ``GET /health`` (no API key), ``GET /metrics`` (Prometheus text),
``GET /slo`` (live SLO report; ``?format=markdown`` for a table). ``n`` up to ``--max-n`` runs
n independent prefill+decode pipelines with the engine's child seeds (see ``router.flow``).

Errors are always ``{"error": {"message", "type", "param", "code"}}``. A streamed request is
started (prefill done, first token in hand) before the 200 and the first byte go out, so "no
instance" (503), "overloaded" (429) and node-side rejections (400) keep their HTTP status;
failures after that arrive as an SSE error event. When the client goes away the request is
aborted upstream: streamed, by Starlette's disconnect listener cancelling the body; not
streamed, by :func:`_until_disconnect`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Coroutine
from contextlib import aclosing
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.core import RouterCore
from router.errors import RouterError, error_body, invalid_request, too_large
from router.flow import GenerateSpec, Usage
from router.openai_format import (
    DONE,
    ChatFormatter,
    ChoiceResult,
    CompletionFormatter,
    sse,
)
from router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    requested_max_tokens,
    to_sampling_params,
)
from router.registry import Registry, Role
from router.sample import SampleDelta
from router.security import GuardMiddleware, HttpGuard

_DISCONNECT_POLL_S = 0.5
_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, logs do

T = TypeVar("T")


def create_app(core: RouterCore, registry: Registry, guard: HttpGuard) -> FastAPI:
    """The HTTP application; ``guard`` runs before routing (limits, API key)."""
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app, core)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_body(await read_body(request, guard), CompletionRequest, core.limits)
        return await _serve_completion(core, request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_body(await read_body(request, guard), ChatCompletionRequest, core.limits)
        return await _serve_chat(core, request, body)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": core.served.name,
            "object": "model",
            "created": core.served.created,
            "owned_by": "pdserve",
            "max_model_len": core.prompts.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = {
            role.value: len(registry.candidates(role)) for role in (Role.PREFILL, Role.DECODE)
        }
        ready = all(counts.values())
        return JSONResponse({"status": "ok", "ready": ready, "instances": counts})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(core.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/slo")
    async def slo(format: str = "json") -> Response:
        report = core.metrics.slo.report()
        if format == "markdown":
            return PlainTextResponse(report.to_markdown())
        return JSONResponse(report.to_dict())

    app.add_middleware(GuardMiddleware, guard=guard)
    return app


async def read_body(request: Request, guard: HttpGuard) -> bytes:
    """The whole body, refusing (413) past ``guard.max_body_bytes`` even without a length."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > guard.max_body_bytes:
            raise too_large(f"request body exceeds {guard.max_body_bytes} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


# ----------------------------------------------------------------------------- endpoints


async def _serve_completion(
    core: RouterCore, request: Request, body: CompletionRequest
) -> Response:
    core.check_model(body.model)
    if isinstance(body.prompt, str):
        prompt_ids, prompt_text = core.prompts.encode_text(body.prompt), body.prompt
    else:
        prompt_ids, prompt_text = list(body.prompt), None
    if body.echo and body.logprobs is not None:
        raise invalid_request("echo together with logprobs is not supported", "echo")
    spec = _prepare(core, body, prompt_ids)
    echo_text = None
    if body.echo:
        echo_text = prompt_text if prompt_text is not None else core.prompts.decode(prompt_ids)
    formatter = CompletionFormatter(
        spec.request_id,
        core.served.name,
        _now(),
        core.prompts,
        logprobs=body.logprobs is not None,
        include_usage=body.include_usage,
        echo_text=echo_text,
    )
    return await _respond(core, request, spec, formatter, body.stream, "completions")


async def _serve_chat(core: RouterCore, request: Request, body: ChatCompletionRequest) -> Response:
    core.check_model(body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    rendered = core.prompts.render_chat(messages, body.add_generation_prompt)
    spec = _prepare(core, body, core.prompts.encode_chat(rendered), prefix="chatcmpl")
    formatter = ChatFormatter(
        spec.request_id,
        core.served.name,
        _now(),
        core.prompts,
        logprobs=body.logprobs,
        include_usage=body.include_usage,
    )
    return await _respond(core, request, spec, formatter, body.stream, "chat")


def _prepare(
    core: RouterCore,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    prefix: str = "cmpl",
) -> GenerateSpec:
    return core.prepare(
        prompt_ids,
        to_sampling_params(body, requested_max_tokens(body)),
        priority=body.priority,
        request_id=f"{prefix}-{uuid.uuid4().hex}",
    )


async def _respond(
    core: RouterCore,
    request: Request,
    spec: GenerateSpec,
    formatter: CompletionFormatter | ChatFormatter,
    stream: bool,
    endpoint: str,
) -> Response:
    usage = Usage()
    deltas = core.run(spec, usage, endpoint)
    if not stream:
        choices = await _until_disconnect(request, _collect(deltas, spec.params.n))
        if choices is None:
            return Response(status_code=_CLIENT_CLOSED)
        return JSONResponse(formatter.response(choices, usage))

    async def first_delta() -> SampleDelta:
        return await anext(deltas)  # raises RouterError before the status line is sent

    first = await _until_disconnect(request, first_delta())
    if first is None:
        return Response(status_code=_CLIENT_CLOSED)
    return _SSEResponse(_sse_body(first, deltas, formatter, usage), media_type="text/event-stream")


async def _collect(deltas: AsyncGenerator[SampleDelta, None], n: int) -> list[ChoiceResult]:
    choices = [ChoiceResult() for _ in range(n)]
    async with aclosing(deltas):
        async for delta in deltas:
            choices[delta.index].add(delta)
    return choices


async def _sse_body(
    first: SampleDelta,
    deltas: AsyncGenerator[SampleDelta, None],
    formatter: CompletionFormatter | ChatFormatter,
    usage: Usage,
) -> AsyncGenerator[bytes, None]:
    async with aclosing(deltas):
        try:
            yield sse(formatter.chunk(first))
            async for delta in deltas:
                yield sse(formatter.chunk(delta))
        except RouterError as exc:
            yield sse(exc.body())
            yield DONE
            return
    if formatter.include_usage:
        yield sse(formatter.usage_chunk(usage))
    yield DONE


class _SSEResponse(StreamingResponse):
    """Closes the body iterator however the response ends, so upstream calls are aborted
    even when the disconnect lands while a chunk is being sent."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()


async def _until_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Await ``work``; None if the client disconnected first (``work`` is then cancelled,
    which aborts the request upstream)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _now() -> int:
    return int(time.time())


# ----------------------------------------------------------------------------- errors


_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
_HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error"}


def _add_error_handlers(app: FastAPI, core: RouterCore) -> None:
    """Every error leaves as an OpenAI error body; refusals before a run are counted."""

    async def router_error(request: Request, exc: RouterError) -> JSONResponse:
        if not exc.metered:
            core.metrics.rejected(_ENDPOINTS.get(request.url.path, "http"), exc.kind)
        return JSONResponse(exc.body(), status_code=exc.status)

    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message = str(exc.errors()[0]["msg"]) if exc.errors() else "invalid request"
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        if exc.status_code >= 500:
            kind = "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        body = error_body(f"internal error: {type(exc).__name__}", "server_error")
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(RouterError, router_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
