"""``pdserve decode``: the Decode RPC over an engine with the KV store connector (consumer).

A request arrives with its prompt, the tokens generated so far (at least the first one, from
the prefill node; more when it resumes here after another decode node died) and the KV handle
the prefill node returned — or with neither handle nor tokens: the router's prefill fallback
(no prefill instance could serve), which this node runs whole, prompt and first token included.
The handle is the contract: it goes into the engine with the request, whose connector checks
it against the prompt (layout fingerprint, block size, the hashes the engine computes once for
its own prefix cache) and loads exactly the entries it names — an entry that is missing or
corrupt is recomputed, never waited for — and tokens stream back as each step makes them. Without a handle the prompt is simply recomputed. Cancelling the call aborts the
request in the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import (
    finish_reason_to_proto,
    kv_handle_from_proto,
    logprob_to_proto,
    sampling_params_from_proto,
)

from common.core_client import CoreOutput, CoreRequestError
from common.core_messages import Ready
from common.kv_interface import KVHandle
from common.lora.adapter import LoraRef, handle_fingerprint
from common.sampling_params import SamplingParams
from node_frontend.options import DECODE_PORT
from node_frontend.runtime import NodeRpcs, NodeRuntime, abort_with, invalid_argument
from node_frontend.server import NodeKind, add_node_command
from node_frontend.stats import TokenTimer


def check_kv_handle(handle: KVHandle, prompt: list[int], info: Ready, lora: LoraRef | None) -> None:
    """Raise ValueError unless ``handle`` is in this node's layout, of the request's adapter
    (``lora``) and of this prompt's length (cheap checks at the door; the engine compares the
    block hashes, which it computes anyway)."""
    own = handle_fingerprint(info.kv_fingerprint or "", lora)
    if handle.fingerprint != own or handle.block_size != info.block_size:
        raise ValueError(
            f"KV handle is for another model or layout, or another LoRA adapter"
            f" ({handle.fingerprint}, block size {handle.block_size}); this request is {own},"
            f" {info.block_size}"
        )
    if handle.num_tokens != len(prompt):
        raise ValueError(f"KV handle holds {handle.num_tokens} tokens, the prompt {len(prompt)}")


def check_decode_request(
    request: pb.DecodeRequest, params: SamplingParams, info: Ready, lora: LoraRef | None
) -> None:
    """Raise ValueError on a request this node cannot run under adapter ``lora`` (the engine
    checks the rest)."""
    if not request.request_id:
        raise ValueError("request_id is required")
    if not request.prompt_token_ids:
        raise ValueError("prompt is empty: at least one token is needed")
    if not request.output_token_ids and request.HasField("kv_handle"):
        raise ValueError("output_token_ids must hold the first token that came with the handle")
    if params.max_tokens is not None and params.max_tokens <= len(request.output_token_ids):
        raise ValueError(
            f"max_tokens={params.max_tokens} leaves nothing to generate after"
            f" {len(request.output_token_ids)} output tokens"
        )
    if request.HasField("kv_handle"):
        handle = kv_handle_from_proto(request.kv_handle)
        check_kv_handle(handle, list(request.prompt_token_ids), info, lora)


class _DecodeStream:
    """Turns one request's core outputs into ``DecodeResponse`` items (and records ITL)."""

    def __init__(self, request: pb.DecodeRequest, params: SamplingParams, runtime: NodeRuntime):
        self.request, self.params, self.runtime = request, params, runtime
        self.timer = TokenTimer(runtime.stats)
        self.num_generated = 0
        self.first = True

    def response(self, items: list[CoreOutput]) -> pb.DecodeResponse:
        """One stream item for one or more consecutive outputs (the last may finish)."""
        msg = pb.DecodeResponse(token_ids=[t for i in items for t in i.output.new_token_ids])
        if self.params.logprobs is not None:
            lps = [lp for i in items for lp in i.output.new_logprobs]
            msg.logprobs.extend(logprob_to_proto(lp) for lp in lps)
        self.num_generated += len(msg.token_ids)
        self.timer.tokens(len(msg.token_ids))
        if self.first:
            self.first = False
            self._kv_load(msg, items[0])
        out = items[-1].output
        if out.finish_reason is not None:
            msg.finish_reason = finish_reason_to_proto(out.finish_reason)
            if isinstance(out.stop_reason, int):
                msg.stop_token_id = out.stop_reason
            msg.usage.CopyFrom(self._usage(out.num_cached_tokens + out.num_external_tokens))
        return msg

    def _kv_load(self, msg: pb.DecodeResponse, item: CoreOutput) -> None:
        out, num_prompt = item.output, len(self.request.prompt_token_ids)
        recomputed = max(num_prompt - out.num_external_tokens - out.num_cached_tokens, 0)
        msg.kv_load.num_loaded_tokens = out.num_external_tokens
        msg.kv_load.num_local_cached_tokens = out.num_cached_tokens
        msg.kv_load.num_recomputed_tokens = recomputed
        msg.kv_load.load_ms = item.timing.load_ms if item.timing is not None else 0.0
        self.runtime.stats.prefill_tokens.add(recomputed)

    def _usage(self, cached: int) -> pb.Usage:
        return pb.Usage(
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=len(self.request.output_token_ids) + self.num_generated,
            cached_prompt_tokens=cached,
        )

    def error(self, error: CoreRequestError) -> pb.DecodeResponse:
        """The last item of a stream that fails after it started."""
        return pb.DecodeResponse(
            finish_reason=pb.FINISH_REASON_ERROR,
            error_message=error.message,
            usage=self._usage(0),
        )


class DecodeServicer(NodeRpcs, pb_grpc.DecodeServiceServicer):
    def __init__(self, runtime: NodeRuntime) -> None:
        self.runtime = runtime

    async def Decode(
        self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DecodeResponse]:
        async with self.runtime.admit(context):
            try:
                params = sampling_params_from_proto(request.sampling_params)
                lora = self.runtime.adapter(request.lora_name)
                check_decode_request(request, params, self.runtime.info, lora)
            except ValueError as e:
                await invalid_argument(context, str(e))
            async for msg in self._stream(request, params, lora, context):
                yield msg

    async def _stream(
        self,
        request: pb.DecodeRequest,
        params: SamplingParams,
        lora: LoraRef | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.DecodeResponse]:
        handle = kv_handle_from_proto(request.kv_handle) if request.HasField("kv_handle") else None
        stream = self.runtime.core.add_request(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            priority=request.priority,
            output_token_ids=list(request.output_token_ids),
            kv_handle=handle,
            lora=lora,
        )
        responses = _DecodeStream(request, params, self.runtime)
        async with stream:
            try:
                async for item in stream:
                    yield responses.response([item, *stream.ready()])
            except CoreRequestError as e:
                if responses.first or e.code == "request_failed":  # a status: not resumed
                    await abort_with(context, e)
                yield responses.error(e)


DECODE_KIND = NodeKind(
    role=pb.ROLE_DECODE,
    kv_role="consumer",
    service_name="pdserve.v1.DecodeService",
    make_servicer=DecodeServicer,
    add_servicer=pb_grpc.add_DecodeServiceServicer_to_server,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    add_node_command(
        subparsers,
        "decode",
        "decode node: KV store + first token → streamed tokens (gRPC)",
        DECODE_PORT,
        DECODE_KIND,
    )
