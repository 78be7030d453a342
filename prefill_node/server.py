"""``pdserve prefill``: the Prefill RPC over an engine with the KV store connector.

A prompt runs with ``max_tokens`` forced to 1: its KV is written to the store block by block
during the forward pass, and the engine samples the first token only once ``wait_for_save`` says
every block is durable, so the reply (first token + KV handle) always names blocks a decode node
can read. The engine's KV role is ``both``: a prefix that another instance already stored is
loaded instead of recomputed (cross-instance prefix reuse).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from common.core_client import CoreOutput, CoreRequestError
from common.sampling_params import SamplingParams
from node_frontend.convert import (
    finish_reason_to_proto,
    kv_handle_to_proto,
    logprob_to_proto,
    sampling_params_from_proto,
)
from node_frontend.options import PREFILL_PORT
from node_frontend.runtime import NodeRpcs, NodeRuntime, abort_with, invalid_argument
from node_frontend.server import NodeKind, add_node_command


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
            stream = self.runtime.core.add_request(
                request.request_id,
                list(request.prompt_token_ids),
                first_token_params(params),
                priority=request.priority,
            )
            async with stream:
                try:
                    item = await anext(stream)
                except CoreRequestError as e:
                    await abort_with(context, e)
            self._record(request, item, arrival)
            return self._response(request, params, item)

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
        self, request: pb.PrefillRequest, params: SamplingParams, item: CoreOutput
    ) -> pb.PrefillResponse:
        out = item.output
        response = pb.PrefillResponse(
            request_id=request.request_id,
            finish_reason=self._finish_reason(request, params, out.finish_reason),
            num_cached_tokens=out.num_cached_tokens,
        )
        if out.new_token_ids:
            response.first_token_id = out.new_token_ids[0]
        if params.logprobs is not None and out.new_logprobs:
            response.first_logprob.CopyFrom(logprob_to_proto(out.new_logprobs[0]))
        if out.kv_handle is not None and out.finish_reason != "abort":
            response.kv_handle.CopyFrom(kv_handle_to_proto(out.kv_handle))
        if isinstance(out.stop_reason, int):
            response.stop_token_id = out.stop_reason
        if item.timing is not None:
            # Blocks are durable before the token is sampled: saving is inside compute_ms.
            timing = item.timing
            response.timing.queue_ms = timing.queue_ms
            response.timing.compute_ms = timing.load_ms + timing.compute_ms
        return response

    def _finish_reason(
        self, request: pb.PrefillRequest, params: SamplingParams, reason: str | None
    ) -> pb.FinishReason.ValueType:
        """``length`` from the forced ``max_tokens=1`` means "go on decoding" unless the request
        itself asked for one token or the context is now full."""
        if reason == "length":
            context_full = len(request.prompt_token_ids) + 1 >= self.runtime.info.max_model_len
            if params.max_tokens != 1 and not context_full:
                return pb.FINISH_REASON_UNSPECIFIED
        return finish_reason_to_proto(reason)


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
