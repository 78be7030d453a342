"""``pdserve prefill``: the Prefill RPC over an engine with the KV store connector.

A request that may generate more than one token is *handed off*: the engine runs it with
``max_tokens`` = 1, its KV is written to the store block by block during the forward pass, and
the engine returns the first token only once ``wait_for_save`` says every block is durable, so
the reply (first token, ``FINISH_REASON_HANDED_OFF`` and the KV handle) always names blocks a
decode node can read. Whether a request is handed off is decided from the request before it
runs, never by reinterpreting the engine's finish reason: the engine's ``stop`` (EOS, a stop id)
ends the request here, and a request that cannot go on (``max_tokens`` == 1, or the context full
after one token) runs as it is and reports the engine's own finish. The engine's KV role is
``both``: a prefix that another instance already stored is loaded instead of recomputed
(cross-instance prefix reuse).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import (
    finish_reason_to_proto,
    kv_handle_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_params_from_proto,
)

from common.core_client import CoreOutput, CoreRequestError
from common.sampling_params import SamplingParams
from node_frontend.options import PREFILL_PORT
from node_frontend.runtime import NodeRpcs, NodeRuntime, abort_with, invalid_argument
from node_frontend.server import NodeKind, add_node_command


def hands_off(params: SamplingParams, prompt_len: int, max_model_len: int) -> bool:
    """Whether the request may generate more than its first token (which may still stop it):
    then it is handed off to a decode node after that token."""
    room = max_model_len - prompt_len
    return min(params.max_tokens or room, room) > 1


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's params with ``max_tokens`` = 1 (``min_tokens`` capped to match, which
    keeps the first token's EOS suppression exactly as in the full request)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))


class PrefillServicer(NodeRpcs, pb_grpc.PrefillServiceServicer):
    def __init__(self, runtime: NodeRuntime) -> None:
        self.runtime = runtime

    async def Prefill(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrefillResponse:
        async with self.runtime.admit(context):
            arrival = time.monotonic()
            params = await self._params(request, context)
            try:
                lora = self.runtime.adapter(request.lora_name)
            except ValueError as e:
                await invalid_argument(context, str(e))
            prompt = list(request.prompt_token_ids)
            handing_off = hands_off(params, len(prompt), self.runtime.info.max_model_len)
            stream = self.runtime.core.add_request(
                request.request_id,
                prompt,
                first_token_params(params) if handing_off else params,
                priority=request.priority,
                lora=lora,
            )
            async with stream:
                try:
                    item = await anext(stream)
                except CoreRequestError as e:
                    await abort_with(context, e)
            self._record(request, item, arrival)
            return self._response(request, params, item, handing_off)

    async def _params(
        self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> SamplingParams:
        if not request.request_id:
            await invalid_argument(context, "request_id is required")
        try:
            return sampling_params_from_proto(request.sampling_params)
        except ValueError as e:
            await invalid_argument(context, str(e))

    def _record(self, request: pb.PrefillRequest, item: CoreOutput, arrival: float) -> None:
        out = item.output
        if out.finish_reason == "abort":
            return
        stats = self.runtime.stats
        stats.ttft_ms.add((time.monotonic() - arrival) * 1e3)
        computed = len(request.prompt_token_ids) - out.num_cached_tokens - out.num_external_tokens
        stats.prefill_tokens.add(max(computed, 0))

    def _response(
        self,
        request: pb.PrefillRequest,
        params: SamplingParams,
        item: CoreOutput,
        handing_off: bool,
    ) -> pb.PrefillResponse:
        out = item.output
        # Handing off, the engine was asked for one token: its "length" is that token, the
        # request goes on; any other finish (stop, abort) is the request's own.
        handed_off = handing_off and out.finish_reason == "length"
        response = pb.PrefillResponse(
            request_id=request.request_id,
            finish_reason=(
                pb.FINISH_REASON_HANDED_OFF
                if handed_off
                else finish_reason_to_proto(out.finish_reason)
            ),
            num_cached_tokens=out.num_cached_tokens,
        )
        if out.new_token_ids:
            response.first_token_id = out.new_token_ids[0]
        if params.logprobs is not None and out.new_logprobs:
            response.first_logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        if out.prompt_logprobs is not None:
            response.prompt_logprobs.CopyFrom(prompt_logprobs_to_proto(out.prompt_logprobs))
        if handed_off and out.kv_handle is not None:
            response.kv_handle.CopyFrom(kv_handle_to_proto(out.kv_handle))
        if isinstance(out.stop_reason, int):
            response.stop_token_id = out.stop_reason
        if item.timing is not None:
            # Blocks are durable before the token is sampled: saving is inside compute_ms.
            timing = item.timing
            response.timing.queue_ms = timing.queue_ms
            response.timing.compute_ms = timing.load_ms + timing.compute_ms
        return response


PREFILL_KIND = NodeKind(
    role=pb.ROLE_PREFILL,
    kv_role="both",
    service_name="pdserve.v1.PrefillService",
    make_servicer=PrefillServicer,
    add_servicer=pb_grpc.add_PrefillServiceServicer_to_server,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    add_node_command(
        subparsers,
        "prefill",
        "prefill node: prompt → KV store + first token (gRPC)",
        PREFILL_PORT,
        PREFILL_KIND,
    )
