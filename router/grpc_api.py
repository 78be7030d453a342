"""``RouterService`` over gRPC: the node registry (Register/Heartbeat/Deregister) and the
client front door (``Generate``, server-streaming).

``Register`` takes the node's ``NodeInfo`` (model, KV fingerprint, block size, max_model_len)
and its load; a node the pool cannot take (another model or fingerprint, a layout the router's
flags rule out) gets FAILED_PRECONDITION and is not added (the pool's fingerprint is named in
the router's log only), and a request without info INVALID_ARGUMENT. With a node key
(``--node-key``, else ``--api-key``) Register, Heartbeat and Deregister require it as
``authorization: Bearer <key>`` (UNAUTHENTICATED otherwise): a rogue process cannot join the
pool and receive prompts. ``Heartbeat`` refreshes the node's load: the one channel through
which the registry's loads (balancing and autoscaling) arrive.

``Generate`` takes text (tokenized here, no chat template) or token ids, streams
``GenerateResponse`` items (new token ids, their text delta, logprobs), the last one with
``finish_reason``, the stop reason and ``usage``. Errors before the first item abort the call
with the RouterError's code (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE, RESOURCE_EXHAUSTED,
UNAUTHENTICATED); a failure after it is a last item with ``FINISH_REASON_ERROR``. Cancelling
the call aborts the request on every instance involved. n is always 1 over gRPC (the proto
has no n).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, NamedTuple

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import (
    finish_reason_to_proto,
    generate_params_from_proto,
    load_from_proto,
    logprob_to_proto,
    node_info_from_proto,
    prompt_logprobs_to_proto,
    role_from_proto,
)

from router.core import RouterCore
from router.errors import RouterError, invalid_request
from router.flow import GenerateSpec, Usage
from router.registry import RegistrationRefused, Registry
from router.sample import SampleDelta
from router.security import bearer_ok

logger = logging.getLogger(__name__)


class RouterServicer(pb_grpc.RouterServiceServicer):
    """Implements RouterService on a ``RouterCore`` and a ``Registry``."""

    def __init__(
        self,
        core: RouterCore,
        registry: Registry,
        api_key: str | None,
        node_key: str | None = None,
    ) -> None:
        self.core = core
        self.registry = registry
        self.api_key = api_key
        self.node_key = node_key  # None: nodes register without a key (a trusted network)

    async def _check_node_key(self, context: grpc.aio.ServicerContext) -> None:
        metadata = dict(context.invocation_metadata() or ())
        if not bearer_ok(metadata.get("authorization"), self.node_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing node key")

    # -- registry ----------------------------------------------------------------------------
    async def Register(
        self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.RegisterResponse:
        await self._check_node_key(context)
        try:
            role = role_from_proto(request.role)
            info = node_info_from_proto(request.info)
            load = load_from_proto(request.load) if request.HasField("load") else None
            self.registry.register(request.instance_id, role, request.address, info, load)
        except RegistrationRefused as exc:
            logger.warning("refused %s at %s: %s", request.instance_id, request.address, exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, exc.public)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        logger.info("registered %s %s at %s", request.instance_id, role.value, request.address)
        return pb.RegisterResponse(heartbeat_interval_s=self.registry.heartbeat_interval_s)

    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        await self._check_node_key(context)
        load = load_from_proto(request.load) if request.HasField("load") else None
        return pb.HeartbeatResponse(known=self.registry.heartbeat(request.instance_id, load))

    async def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterResponse:
        await self._check_node_key(context)
        instance = self.registry.deregister(request.instance_id)
        if instance is not None:
            logger.info("deregistered %s at %s", instance.instance_id, instance.address)
        return pb.DeregisterResponse(known=instance is not None)

    # -- front door --------------------------------------------------------------------------
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        metadata = dict(context.invocation_metadata() or ())
        if not bearer_ok(metadata.get("authorization"), self.api_key):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid or missing API key")
        try:
            spec, prompt_text = await self._prepare(request)
        except RouterError as exc:
            self.core.metrics.rejected("grpc", exc.kind)
            await context.abort(_code(exc), exc.message)
        usage = Usage()
        deltas = self.core.run(spec, usage, "grpc")
        async with aclosing(deltas):
            first = True
            try:
                async for delta in deltas:
                    item = _response(spec.request_id, delta, usage)
                    if first and request.echo:
                        item.prompt_token_ids.extend(spec.prompt_token_ids)
                        item.prompt_text = prompt_text
                    first = False
                    yield item
            except RouterError as exc:
                if first:
                    await context.abort(_code(exc), exc.message)
                yield pb.GenerateResponse(
                    request_id=spec.request_id,
                    finish_reason=pb.FINISH_REASON_ERROR,
                    error_message=exc.message,
                    usage=_usage(usage),
                )

    async def _prepare(self, request: pb.GenerateRequest) -> tuple[GenerateSpec, str]:
        """The spec and the prompt's text; raises RouterError on bad input. Tokenizing runs
        off the event loop (``RouterCore.offload``)."""
        lora_name = self.core.check_model(request.model)
        prompts = self.core.prompts
        kind = request.WhichOneof("prompt")
        if kind == "text":
            self.core.check_text(request.text)
            prompt_ids, text = (
                await self.core.offload(prompts.encode_text, request.text),
                request.text,
            )
        elif kind == "token_ids":
            prompt_ids = list(request.token_ids.ids)
            text = prompts.decode(prompt_ids) if request.echo else ""
        else:
            raise invalid_request("prompt is missing: set text or token_ids", "prompt")
        try:
            params = generate_params_from_proto(request)
        except ValueError as exc:
            raise invalid_request(str(exc)) from None
        return (
            self.core.prepare(
                prompt_ids,
                params,
                priority=request.priority if request.HasField("priority") else 0,
                request_id=request.request_id if request.HasField("request_id") else None,
                lora_name=lora_name,
            ),
            text,
        )


def _response(request_id: str, delta: SampleDelta, usage: Usage) -> pb.GenerateResponse:
    item = pb.GenerateResponse(request_id=request_id, token_ids=delta.token_ids, text=delta.text)
    item.logprobs.extend(logprob_to_proto(lp) for lp in delta.logprobs)
    if delta.prompt_logprobs is not None:
        item.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(delta.prompt_logprobs))
    if delta.finish_reason is not None:
        item.finish_reason = finish_reason_to_proto(delta.finish_reason)
        if isinstance(delta.stop_reason, str):
            item.stop_string = delta.stop_reason
        elif isinstance(delta.stop_reason, int):
            item.stop_token_id = delta.stop_reason
        item.usage.CopyFrom(_usage(usage))
    return item


def _usage(usage: Usage) -> pb.Usage:
    return pb.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_prompt_tokens=usage.cached_tokens,
    )


# -- the wire: requests that do not decode are INVALID_ARGUMENT (grpc's own answer: UNKNOWN) --

SERVICE = "pdserve.v1.RouterService"


class _Undecodable(NamedTuple):
    """What a request that is not a valid protobuf of its type becomes."""

    type_name: str
    error: str


def _lenient(message: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message.FromString(data)
        except Exception as exc:  # protobuf's DecodeError (or upb's own)
            return _Undecodable(message.DESCRIPTOR.name, str(exc) or type(exc).__name__)

    return parse


async def _refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
    message = f"the request is not a valid {request.type_name}: {request.error}"
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)


def _unary(method: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        return await method(request, context)

    return call


def _stream(method: Callable[[Any, Any], AsyncGenerator[Any, None]]):  # type: ignore[no-untyped-def]
    async def call(request: Any, context: grpc.aio.ServicerContext) -> AsyncGenerator[Any, None]:
        if isinstance(request, _Undecodable):
            await _refuse(request, context)
        async with aclosing(method(request, context)) as items:
            async for item in items:
                yield item

    return call


def add_router_service(servicer: RouterServicer, server: grpc.aio.Server) -> None:
    """Serve ``servicer`` as RouterService (the generated registration, with requests that
    do not decode refused as INVALID_ARGUMENT instead of grpc's UNKNOWN)."""
    unary = {
        "Register": (pb.RegisterRequest, pb.RegisterResponse),
        "Heartbeat": (pb.HeartbeatRequest, pb.HeartbeatResponse),
        "Deregister": (pb.DeregisterRequest, pb.DeregisterResponse),
    }
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            _unary(getattr(servicer, name)),
            request_deserializer=_lenient(request),
            response_serializer=response.SerializeToString,
        )
        for name, (request, response) in unary.items()
    }
    handlers["Generate"] = grpc.unary_stream_rpc_method_handler(
        _stream(servicer.Generate),
        request_deserializer=_lenient(pb.GenerateRequest),
        response_serializer=pb.GenerateResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _code(exc: RouterError) -> grpc.StatusCode:
    return grpc.StatusCode.NOT_FOUND if exc.status == 404 else exc.grpc_code
