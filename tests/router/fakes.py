"""In-process fake prefill/decode nodes for router tests that need no engine.

The fake "model" is a pure function: output token ``i`` of a request with seed ``s`` is
``fake_token(s, i)``, wherever it is computed. So a decode resumed from ``output_token_ids``
continues the same sequence, and any duplicated or missing token shows in the output.
Behaviour is scripted per node (``fail``: ``None`` | ``"unavailable"`` | ``"busy"`` |
``"invalid"`` | ``"failed"``; ``die_after``: abort the decode stream with UNAVAILABLE after that many
items, as a crashed node's connection reset would).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import node_info_to_proto
from pdserve_proto.nodes import NodeInfo

FINGERPRINT = "fake-fingerprint"
EOS = 2
# What every fake node serves (the tiny model's context: max_position_embeddings).
INFO = NodeInfo("tiny-llama", FINGERPRINT, block_size=16, max_model_len=4096)


def fake_token(seed: int, position: int) -> int:
    """The fake model's output token at ``position`` for ``seed`` (never a special id)."""
    return 300 + (seed * 31 + position * 17) % 600  # merged tokens: printable text


def fake_tokens(seed: int, count: int) -> list[int]:
    return [fake_token(seed, i) for i in range(count)]


def fake_prompt_logprob(token_id: int) -> float:
    """The fake model's logprob of a prompt token."""
    return -0.5 - token_id % 7


def fake_logprobs(params: pb.SamplingParams, ids: list[int]) -> list[pb.TokenLogprob]:
    """Output logprobs when asked for (-1.0 each; top k: ids 3, 4, …)."""
    if not params.HasField("logprobs"):
        return []
    top = list(range(3, 3 + params.logprobs))
    return [
        pb.TokenLogprob(token_id=t, logprob=-1.0, top_token_ids=top, top_logprobs=[-2.0] * len(top))
        for t in ids
    ]


def fake_prompt_logprobs(request: pb.PrefillRequest) -> pb.PromptLogprobs | None:
    """Prompt logprobs when the request asks for them (top k: ids 3, 4, …)."""
    params = request.sampling_params
    if not params.HasField("prompt_logprobs"):
        return None
    k = params.prompt_logprobs
    tokens = [
        pb.TokenLogprob(
            token_id=t,
            logprob=fake_prompt_logprob(t),
            top_token_ids=range(3, 3 + k),
            top_logprobs=[-0.25 * (i + 1) for i in range(k)],
        )
        for t in request.prompt_token_ids[1:]
    ]
    return pb.PromptLogprobs(tokens=tokens)


@dataclass
class Script:
    """What a fake node does; tests mutate it between requests."""

    fail: str | None = None
    die_after: int | None = None  # decode: abort with UNAVAILABLE after this many items
    delay_s: float = 0.0  # before the prefill reply / between decode items
    tokens_per_item: int = 1
    prefill_finish: int = pb.FINISH_REASON_HANDED_OFF  # prefill: a request that goes on
    finish_at_one: int = pb.FINISH_REASON_LENGTH  # prefill: a request of max_tokens == 1
    seen: list[str] = field(default_factory=list)  # request ids received
    aborted: list[str] = field(default_factory=list)  # Abort() calls
    cancelled: list[str] = field(default_factory=list)  # calls the client cancelled
    requests: list[object] = field(default_factory=list)


async def _maybe_fail(script: Script, context: grpc.aio.ServicerContext) -> None:
    codes = {
        "unavailable": grpc.StatusCode.UNAVAILABLE,
        "busy": grpc.StatusCode.RESOURCE_EXHAUSTED,
        "invalid": grpc.StatusCode.INVALID_ARGUMENT,
        "failed": grpc.StatusCode.ABORTED,  # the request failed in the node's engine
    }
    if script.fail is not None:
        await context.abort(codes[script.fail], f"scripted {script.fail}")


def _max_tokens(params: pb.SamplingParams) -> int:
    return params.max_tokens if params.HasField("max_tokens") else 16


class FakePrefill(pb_grpc.PrefillServiceServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def Prefill(self, request: pb.PrefillRequest, context) -> pb.PrefillResponse:
        self.script.seen.append(request.request_id)
        self.script.requests.append(request)
        await _maybe_fail(self.script, context)
        try:
            await asyncio.sleep(self.script.delay_s)
        except asyncio.CancelledError:
            self.script.cancelled.append(request.request_id)
            raise
        seed = request.sampling_params.seed
        first = fake_token(seed, 0)
        scored = fake_prompt_logprobs(request)
        [first_logprob] = fake_logprobs(request.sampling_params, [first]) or [None]
        if _max_tokens(request.sampling_params) == 1:  # the first token ends the request
            return pb.PrefillResponse(
                request_id=request.request_id,
                first_token_id=first,
                first_logprob=first_logprob,
                finish_reason=self.script.finish_at_one,
                prompt_logprobs=scored,
            )
        handle = pb.KVHandle(
            fingerprint=FINGERPRINT, block_size=16, num_tokens=len(request.prompt_token_ids)
        )
        return pb.PrefillResponse(
            request_id=request.request_id,
            first_token_id=first,
            first_logprob=first_logprob,
            kv_handle=handle,
            finish_reason=self.script.prefill_finish,
            num_cached_tokens=0,
            prompt_logprobs=scored,
        )

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        self.script.aborted.append(request.request_id)
        return pb.AbortResponse(found=False)

    async def GetLoad(self, request, context) -> pb.LoadReport:
        return pb.LoadReport(role=pb.ROLE_PREFILL, num_total_blocks=10, num_free_blocks=10)

    async def GetInfo(self, request, context) -> pb.NodeInfo:
        return node_info_to_proto(INFO)


class FakeDecode(pb_grpc.DecodeServiceServicer):
    def __init__(self, script: Script) -> None:
        self.script = script

    async def Decode(self, request: pb.DecodeRequest, context):
        self.script.seen.append(request.request_id)
        self.script.requests.append(request)
        await _maybe_fail(self.script, context)
        seed = request.sampling_params.seed
        total = _max_tokens(request.sampling_params)
        position = len(request.output_token_ids)
        items = 0
        try:
            while position < total:
                if self.script.die_after is not None and items >= self.script.die_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted crash")
                await asyncio.sleep(self.script.delay_s)
                count = min(self.script.tokens_per_item, total - position)
                ids = [fake_token(seed, position + k) for k in range(count)]
                position += count
                items += 1
                done = position >= total
                yield pb.DecodeResponse(
                    token_ids=ids,
                    logprobs=fake_logprobs(request.sampling_params, ids),
                    finish_reason=pb.FINISH_REASON_LENGTH if done else 0,
                    usage=pb.Usage(completion_tokens=position) if done else None,
                )
        except asyncio.CancelledError:
            self.script.cancelled.append(request.request_id)
            raise

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        self.script.aborted.append(request.request_id)
        return pb.AbortResponse(found=False)

    async def GetLoad(self, request, context) -> pb.LoadReport:
        return pb.LoadReport(role=pb.ROLE_DECODE, num_total_blocks=10, num_free_blocks=10)

    async def GetInfo(self, request, context) -> pb.NodeInfo:
        return node_info_to_proto(INFO)


@dataclass
class FakeNode:
    role: str
    address: str
    script: Script
    server: grpc.aio.Server

    async def stop(self) -> None:
        await self.server.stop(None)


async def start_fake(
    role: str, script: Script | None = None, tls: grpc.ServerCredentials | None = None
) -> FakeNode:
    """A fake node of ``role`` ("prefill" | "decode") on a free loopback port (TLS if given)."""
    script = script or Script()
    server = grpc.aio.server()
    if role == "prefill":
        pb_grpc.add_PrefillServiceServicer_to_server(FakePrefill(script), server)
    else:
        pb_grpc.add_DecodeServiceServicer_to_server(FakeDecode(script), server)
    health_servicer = health.aio.HealthServicer()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", tls)
    await server.start()
    return FakeNode(role, f"127.0.0.1:{port}", script, server)
