"""The OpenAI-compatible HTTP front door (FastAPI), sharing the event loop with gRPC.

Routes: ``POST /v1/completions`` (one prompt or a batch: choice ``i*n + j`` is sample ``j`` of
prompt ``i``, as in OpenAI and vLLM), ``POST /v1/chat/completions`` (streaming or not),
``GET /v1/models`` and ``GET /v1/models/{id}`` (``max_model_len``: the registered nodes', null
until one has registered), vLLM's ``POST /tokenize`` and ``POST /detokenize``, ``GET /version``,
``GET /openapi.json``,
``GET /health`` (liveness: always 200) and ``GET /ready`` (readiness: 503 until a prefill path
and a decode instance can serve; see :func:`readiness`), both without API key,
``GET /metrics`` (Prometheus text),
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
import dataclasses
import importlib.metadata
import logging
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
from starlette.requests import ClientDisconnect

from router import lora_admin
from router.core import RouterCore
from router.errors import RouterError, error_body, invalid_request, too_large
from router.flow import FlowConfig, GenerateSpec, Usage
from router.merge import merged
from router.openai_format import (
    DONE,
    ChatFormatter,
    ChoiceResult,
    CompletionFormatter,
    EchoPrompt,
    sse,
)
from router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
    parse_body,
    parse_model,
    requested_max_tokens,
    to_sampling_params,
)
from router.registry import Registry, Role
from router.sample import SampleDelta
from router.security import GuardMiddleware, HttpGuard, drain, json_too_deep

logger = logging.getLogger(__name__)

_DISCONNECT_POLL_S = 0.5
_CANCEL_RETRY_S = 0.1
_CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it, logs do

T = TypeVar("T")


def _version() -> str:
    try:
        return importlib.metadata.version("pdserve")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


VERSION = _version()


def create_app(core: RouterCore, registry: Registry, guard: HttpGuard) -> FastAPI:
    """The HTTP application; ``guard`` runs before routing (limits, API key)."""
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, version=VERSION)
    _add_error_handlers(app, core)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        raw = await read_body(request, guard)
        body = await core.offload(parse_body, raw, CompletionRequest, core.limits)
        return await _serve_completion(core, request, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        raw = await read_body(request, guard)
        body = await core.offload(parse_body, raw, ChatCompletionRequest, core.limits)
        return await _serve_chat(core, request, body)

    def model_card(lora_name: str = "") -> dict[str, Any]:
        card = {
            "id": lora_name or core.served.name,
            "object": "model",
            "created": core.served.created,
            "owned_by": "pdserve",
            "max_model_len": registry.max_model_len(),  # the nodes'; null before one registers
        }
        if lora_name:  # vLLM's card of an adapter: its base model is the parent
            card.update(root=lora_name, parent=core.served.name)
        return card

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        adapters = sorted(registry.lora_adapters())
        return {"object": "list", "data": [model_card(), *map(model_card, adapters)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        return model_card(core.check_model(model_id or "\0"))  # an empty id names no model

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = parse_model(await read_body(request, guard), LoadLoraAdapterRequest)
        await lora_admin.load_lora_adapter(core.flow.registry, core.flow.clients, body.lora_name,
                                body.lora_path)  # fmt: skip
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = parse_model(await read_body(request, guard), UnloadLoraAdapterRequest)
        await lora_admin.unload_lora_adapter(core.flow.registry, core.flow.clients, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await core.offload(parse_model, await read_body(request, guard), TokenizeRequest)
        core.check_model(body.model)
        ids = await core.offload(_tokenize, core, body)
        strs = [core.prompts.tokenizer.convert_ids_to_tokens(i) for i in ids]
        return {
            "count": len(ids),
            "max_model_len": registry.max_model_len(),
            "tokens": ids,
            "token_strs": strs if body.return_token_strs else None,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = parse_model(await read_body(request, guard), DetokenizeRequest)
        core.check_model(body.model)
        core.prompts.check_token_ids(body.tokens, param="tokens")
        return {"prompt": core.prompts.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/health")
    async def health() -> JSONResponse:
        """Liveness: the router answers. Always 200 (with the readiness fields for humans)."""
        return JSONResponse({"status": "ok", **readiness(registry, core.flow.config)})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Readiness: 200 when a request can be served now, else 503; same body either way."""
        body = readiness(registry, core.flow.config)
        body["status"] = "ready" if body["ready"] else "not_ready"
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

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


def readiness(registry: Registry, flow: FlowConfig) -> dict[str, Any]:
    """``ready``: a decode instance and a prefill path (a prefill instance, or any decode
    instance while ``--prefill-fallback`` is on) are healthy now; ``instances``: healthy ones
    per pool; ``prefill_fallback``: the flag. Instances are registered (or static and
    answering), of the served model and layout, not draining, not suspect after a failure."""
    counts = {role.value: len(registry.candidates(role)) for role in (Role.PREFILL, Role.DECODE)}
    decode = counts[Role.DECODE.value] > 0
    prefill_path = counts[Role.PREFILL.value] > 0 or (flow.prefill_fallback and decode)
    return {
        "ready": decode and prefill_path,
        "instances": counts,
        "prefill_fallback": flow.prefill_fallback,
    }


async def read_body(request: Request, guard: HttpGuard) -> bytes:
    """The whole body, refusing (413) past ``guard.max_body_bytes`` even without a length
    (the rest is drained first, so the client reads the 413), and JSON nested deeper than
    ``guard.max_json_depth`` (400, before any parser recurses into it). A body declared as
    anything but JSON (``text/plain``, a form) is refused (415); an undeclared one is read."""
    _check_json_type(request.headers.get("content-type"))
    chunks: list[bytes] = []
    size, more = 0, True
    while more:  # ASGI messages, not request.stream(): draining needs to know if more comes
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk, more = message.get("body", b""), message.get("more_body", False)
        size += len(chunk)
        if size > guard.max_body_bytes:
            if more:
                await drain(request.receive)
            raise too_large(f"request body exceeds {guard.max_body_bytes} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    if json_too_deep(body, guard.max_json_depth):
        raise invalid_request(f"the JSON body nests deeper than {guard.max_json_depth} levels")
    return body


def _check_json_type(content_type: str | None) -> None:
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        error = invalid_request(
            f"the request body must be JSON (Content-Type: application/json), not {media!r}",
            code="unsupported_media_type",
        )
        error.status = 415
        raise error


# ----------------------------------------------------------------------------- endpoints


async def _serve_completion(
    core: RouterCore, request: Request, body: CompletionRequest
) -> Response:
    lora_name = core.check_model(body.model)
    prompts = body.prompts()
    for text in prompts:  # tokenized off the loop below; refused here when it cannot fit
        if isinstance(text, str):
            core.check_text(text)
    prompt_ids = await core.offload(
        lambda: [core.prompts.encode_text(p) if isinstance(p, str) else list(p) for p in prompts]
    )
    request_id = f"cmpl-{uuid.uuid4().hex}"
    specs = [_prepare(core, body, ids, request_id, lora_name) for ids in prompt_ids]
    echo = None
    if body.echo:
        echo = [
            EchoPrompt(  # a token-id prompt echoed whole: its special tokens too (vLLM)
                p if isinstance(p, str) else core.prompts.decode(ids, skip_special_tokens=False),
                ids,
            )
            for p, ids in zip(prompts, prompt_ids)
        ]
    formatter = CompletionFormatter(
        request_id,
        lora_name or core.served.name,
        _now(),
        core.prompts,
        logprobs=body.logprobs is not None,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        prompt_logprobs=body.prompt_logprobs is not None,
        echo=echo,
        n=body.n,
    )
    return await _respond(core, request, specs, formatter, body.stream, "completions")


async def _serve_chat(core: RouterCore, request: Request, body: ChatCompletionRequest) -> Response:
    lora_name = core.check_model(body.model)
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    core.check_text("".join(m["content"] for m in messages))
    rendered = await core.offload(
        core.prompts.render_chat,
        messages,
        body.add_generation_prompt,
        body.chat_template_kwargs,
        body.continue_final_message,
    )
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    prompt_ids = await core.offload(core.prompts.encode_chat, rendered)
    spec = _prepare(core, body, prompt_ids, request_id, lora_name)
    formatter = ChatFormatter(
        request_id,
        lora_name or core.served.name,
        _now(),
        core.prompts,
        logprobs=body.logprobs,
        include_usage=body.include_usage,
        continuous_usage=body.continuous_usage,
        prompt_logprobs=body.prompt_logprobs is not None,
    )
    formatter.echo = body.echo_text()
    return await _respond(core, request, [spec], formatter, body.stream, "chat")


def _prepare(
    core: RouterCore,
    body: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    request_id: str,
    lora_name: str,
) -> GenerateSpec:
    """One prompt's spec under ``lora_name`` (the adapter its ``model`` named, ``""``: the base
    model). ``max_tokens=0`` (completions with echo) runs the prefill only, for the prompt's
    logprobs: the node samples one token, which is dropped."""
    max_tokens = requested_max_tokens(body)
    prefill_only = max_tokens == 0
    params = to_sampling_params(body, 1 if prefill_only else max_tokens)
    beam = None
    if isinstance(body, CompletionRequest) and body.use_beam_search:
        beam = (body.beam_width, body.length_penalty)
    spec = core.prepare(
        prompt_ids, params, priority=body.priority, request_id=request_id, beam=beam,
        lora_name=lora_name,
    )  # fmt: skip
    return dataclasses.replace(spec, prefill_only=prefill_only) if prefill_only else spec


def _tokenize(core: RouterCore, body: TokenizeRequest) -> list[int]:
    """vLLM's /tokenize: a prompt (special tokens added by default) or chat messages
    (rendered with the template; no special tokens added by default)."""
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        rendered = core.prompts.render_chat(
            messages, body.add_generation_prompt, body.chat_template_kwargs
        )
        add_special = bool(body.add_special_tokens)
        return core.prompts.encode_text(rendered, add_special_tokens=add_special)
    assert body.prompt is not None  # TokenizeRequest checks one of the two is given
    add_special = body.add_special_tokens is None or body.add_special_tokens
    return core.prompts.encode_text(body.prompt, add_special_tokens=add_special)


async def _respond(
    core: RouterCore,
    request: Request,
    specs: list[GenerateSpec],
    formatter: CompletionFormatter | ChatFormatter,
    stream: bool,
    endpoint: str,
) -> Response:
    """Run ``specs`` (one per prompt) and answer with one body or one SSE stream."""
    usages = [Usage() for _ in specs]
    deltas = _batch(core, specs, usages, endpoint)
    n = specs[0].params.n
    if not stream:
        choices = await _until_disconnect(request, _collect(deltas, n * len(specs)))
        if choices is None:
            return Response(status_code=_CLIENT_CLOSED)
        return JSONResponse(formatter.response(choices, total_usage(usages)))

    async def first_delta() -> SampleDelta:
        return await anext(deltas)  # raises RouterError before the status line is sent

    first = await _until_disconnect(request, first_delta())
    if first is None:
        return Response(status_code=_CLIENT_CLOSED)
    body = _sse_body(first, deltas, formatter, usages)
    return _SSEResponse(body, media_type="text/event-stream")


async def _batch(
    core: RouterCore, specs: list[GenerateSpec], usages: list[Usage], endpoint: str
) -> AsyncGenerator[SampleDelta, None]:
    """Every prompt's deltas, interleaved as they come, sample ``j`` of prompt ``i`` renumbered
    ``i*n + j``. Closing this aborts every prompt's run."""

    async def renumbered(i: int) -> AsyncGenerator[SampleDelta, None]:
        base = i * specs[i].params.n
        async with aclosing(core.run(specs[i], usages[i], endpoint)) as deltas:
            async for delta in deltas:
                yield dataclasses.replace(delta, index=base + delta.index)

    async with aclosing(merged([renumbered(i) for i in range(len(specs))])) as deltas:
        async for delta in deltas:
            yield delta


def total_usage(usages: list[Usage]) -> Usage:
    """The batch's usage: every prompt's summed (cached tokens too)."""
    total = Usage()
    for usage in usages:
        total.prompt_tokens += usage.prompt_tokens
        total.completion_tokens += usage.completion_tokens
        total.cached_tokens += usage.cached_tokens
    return total


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
    usages: list[Usage],
) -> AsyncGenerator[bytes, None]:
    async with aclosing(deltas):
        try:
            yield sse(formatter.chunk(first, total_usage(usages)))
            async for delta in deltas:
                yield sse(formatter.chunk(delta, total_usage(usages)))
        except RouterError as exc:
            yield sse(exc.body())
            yield DONE
            return
    if formatter.include_usage:
        yield sse(formatter.usage_chunk(total_usage(usages)))
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
    which aborts the request upstream).

    Non-streaming responses get no disconnect notice from Starlette: this watcher polls
    ``request.is_disconnected()`` and cancels. A cancellation can be lost in a race (code that
    catches it as an item arrives), so it is repeated until the work has ended."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return None
    finally:
        while not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=_CANCEL_RETRY_S)
        if not task.cancelled():
            task.exception()  # retrieved: the client is gone, nobody else will read it


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

    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = error_body(f"internal error: {type(exc).__name__}", "server_error")
        return JSONResponse(body, status_code=500)

    app.add_exception_handler(RouterError, router_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, internal_error)
