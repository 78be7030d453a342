"""The request flow: prefill (retried elsewhere on failure), first token out, decode stream
(migrated elsewhere when its node dies), detokenization, stop strings, finish.

NOTE on faults. Failures are classified by gRPC status code (``_classify``):

- *transport* (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED by the peer, UNKNOWN, INTERNAL) — the
  instance died or misbehaved: it is marked suspect (balancers skip it for a cooldown) and the
  step is retried on another instance, at most ``max_retries`` times per step;
- *busy* (RESOURCE_EXHAUSTED) — the instance is full: try another; if every candidate is full
  the client gets 429 / RESOURCE_EXHAUSTED;
- anything else (INVALID_ARGUMENT, …) is the request's fault and goes back to the client.

A decode is resumed with ``DecodeRequest.output_token_ids`` = every token the client has been
sent (``SampleState.token_ids``); the request's fixed seed makes the new node sample exactly
what the old one would have. Cancelling the flow (client gone) cancels the node calls and sends
a best-effort ``Abort`` so the nodes free the request's blocks at once.

n > 1 runs n independent prefill+decode pipelines, sample ``i`` seeded with the engine's child
seed of the request seed (``router.sample.sample_seed``): the same samples the offline LLM draws.
Prefix affinity sends the n prefills to the same prefill instance, whose prefix cache then
computes the shared prompt once.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from pdserve_proto import pdserve_pb2 as pb

from common.block_hash import hash_blocks
from common.sampling_params import SamplingParams
from router.balancer import DecodePolicy, PrefillPolicy, PromptInfo
from router.errors import RouterError, invalid_request, no_instance, overloaded, upstream_failure
from router.node_clients import NodeClients
from router.registry import Instance, Registry, Role
from router.sample import SampleDelta, SampleState, sample_seed, to_proto_sampling

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FlowConfig:
    """Retry budget and timeouts. ``block_size`` only shapes prefix-affinity hashes.

    ``decode_stall_timeout_s`` bounds the wait for a decode stream's next item: a node that
    stops answering without closing its connection is treated as dead (the request resumes
    elsewhere).
    """

    block_size: int = 16
    max_retries: int = 3
    prefill_timeout_s: float = 300.0
    decode_stall_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_retries < 0:
            raise ValueError("block_size must be >= 1 and max_retries >= 0")
        if self.prefill_timeout_s <= 0 or self.decode_stall_timeout_s <= 0:
            raise ValueError("timeouts must be > 0")


@dataclass
class GenerateSpec:
    """A validated request. ``params.seed`` is always set (the router draws one if needed).

    Node-side ids are ``{request_id}-{nonce}-{sample}-{p|d}{attempt}``: the nonce keeps them
    unique even when clients reuse a ``request_id``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))

    def upstream_id(self, index: int, step: str) -> str:
        return f"{self.request_id}-{self.nonce}-{index}-{step}"


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    retries: int = 0
    migrations: int = 0


class _Fault(enum.Enum):
    TRANSPORT = "transport"
    BUSY = "busy"
    REQUEST = "request"


def _classify(exc: grpc.aio.AioRpcError) -> _Fault:
    code = exc.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _Fault.BUSY
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return _Fault.REQUEST
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return _Fault.REQUEST
    return _Fault.TRANSPORT


class _NodeGaveUp(Exception):
    """A node ended a request it should have finished (ABORT/ERROR, or a truncated stream)."""


class RequestFlow:
    """Runs requests across the pools. Shared by the HTTP and gRPC front doors.

    Owns nothing it is given; keeps only the set of background Abort tasks.
    """

    def __init__(
        self,
        registry: Registry,
        clients: NodeClients,
        tokenizer: object,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        config: FlowConfig,
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.tokenizer = tokenizer
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.config = config
        self._aborts: set[asyncio.Task[None]] = set()

    def prompt_info(self, token_ids: list[int]) -> PromptInfo:
        size = self.config.block_size
        return PromptInfo(len(token_ids), hash_blocks(token_ids, size), size)

    async def generate(self, spec: GenerateSpec, usage: Usage) -> AsyncGenerator[SampleDelta, None]:
        """Every sample's deltas, interleaved; ``usage`` is filled in as the request runs.

        Raises RouterError. Closing the iterator (or cancelling its consumer) aborts upstream.
        """
        usage.prompt_tokens = len(spec.prompt_token_ids)
        prompt = self.prompt_info(spec.prompt_token_ids)
        if spec.params.n == 1:
            deltas = self._sample(spec, 0, prompt, usage)
        else:
            deltas = self._fan_out(spec, prompt, usage)
        # aclosing: closing this generator must close the inner ones at once (cancel upstream)
        async with aclosing(deltas):
            async for delta in deltas:
                yield delta

    async def _fan_out(
        self, spec: GenerateSpec, prompt: PromptInfo, usage: Usage
    ) -> AsyncGenerator[SampleDelta, None]:
        queue: asyncio.Queue[SampleDelta | BaseException | None] = asyncio.Queue()

        async def pump(index: int) -> None:
            try:
                async with aclosing(self._sample(spec, index, prompt, usage)) as deltas:
                    async for delta in deltas:
                        queue.put_nowait(delta)
                queue.put_nowait(None)
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait(exc)

        tasks = [asyncio.create_task(pump(i)) for i in range(spec.params.n)]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item is None:
                    remaining -= 1
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _sample(
        self, spec: GenerateSpec, index: int, prompt: PromptInfo, usage: Usage
    ) -> AsyncGenerator[SampleDelta, None]:
        assert spec.params.seed is not None, "the router always sets a seed"
        sampling = to_proto_sampling(spec.params, sample_seed(spec.params.seed, index))
        state = SampleState(index, self.tokenizer, spec.prompt_token_ids, spec.params)
        response = await self._prefill(spec, index, sampling, prompt, usage)
        if index == 0:
            usage.cached_tokens = response.num_cached_tokens
        stop_id = response.stop_token_id if response.HasField("stop_token_id") else None
        logprobs = [response.first_logprob] if response.HasField("first_logprob") else []
        delta = state.push([response.first_token_id], logprobs, response.finish_reason, stop_id)
        usage.completion_tokens += len(delta.token_ids)
        yield delta
        if state.finished:
            return
        decode = self._decode(spec, index, sampling, response.kv_handle, state, usage)
        async with aclosing(decode):
            async for delta in decode:
                usage.completion_tokens += len(delta.token_ids)
                yield delta

    # -- prefill -----------------------------------------------------------------------------
    async def _prefill(
        self,
        spec: GenerateSpec,
        index: int,
        sampling: pb.SamplingParams,
        prompt: PromptInfo,
        usage: Usage,
    ) -> pb.PrefillResponse:
        """Prefill on the best instance, retrying elsewhere on transport faults or busy."""
        tried: set[str] = set()
        last_fault: _Fault | None = None
        for attempt in range(self.config.max_retries + 1):
            candidates = self.registry.candidates(Role.PREFILL, frozenset(tried))
            if not candidates:
                break
            instance = self.prefill_policy.choose(candidates, prompt)
            tried.add(instance.instance_id)
            request = pb.PrefillRequest(
                request_id=spec.upstream_id(index, f"p{attempt}"),
                prompt_token_ids=spec.prompt_token_ids,
                sampling_params=sampling,
                priority=spec.priority,
            )
            try:
                response = await self._call_prefill(instance, request, prompt.num_tokens)
            except grpc.aio.AioRpcError as exc:
                last_fault = self._on_rpc_error(instance, exc, "prefill")
                usage.retries += 1
                continue
            except _NodeGaveUp as exc:
                logger.warning("prefill on %s gave up: %s", instance.address, exc)
                last_fault = _Fault.TRANSPORT
                usage.retries += 1
                continue
            return response
        raise self._exhausted("prefill", last_fault, tried)

    async def _call_prefill(
        self, instance: Instance, request: pb.PrefillRequest, num_tokens: int
    ) -> pb.PrefillResponse:
        stub = self.clients.prefill(instance.address)
        with self.registry.track(instance, num_tokens):
            try:
                response = await stub.Prefill(request, timeout=self.config.prefill_timeout_s)
            except BaseException as exc:
                if isinstance(exc, asyncio.CancelledError) or _timed_out(exc):
                    self._abort_later(instance, request.request_id, Role.PREFILL)
                raise
        if response.finish_reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ERROR):
            raise _NodeGaveUp(response.error_message or "aborted")
        return response

    # -- decode ------------------------------------------------------------------------------
    async def _decode(
        self,
        spec: GenerateSpec,
        index: int,
        sampling: pb.SamplingParams,
        kv_handle: pb.KVHandle,
        state: SampleState,
        usage: Usage,
    ) -> AsyncGenerator[SampleDelta, None]:
        """Stream from a decode instance; when it fails, resume on another from the tokens
        already sent. Ends when the sample finishes; raises RouterError when out of options."""
        tried: set[str] = set()
        failures = 0
        last_fault: _Fault | None = None
        prompt = PromptInfo(len(spec.prompt_token_ids), (), self.config.block_size)
        while failures <= self.config.max_retries:
            candidates = self.registry.candidates(Role.DECODE, frozenset(tried))
            if not candidates:
                break
            instance = self.decode_policy.choose(candidates, prompt)
            tried.add(instance.instance_id)
            request = pb.DecodeRequest(
                request_id=spec.upstream_id(index, f"d{failures}"),
                prompt_token_ids=spec.prompt_token_ids,
                output_token_ids=state.token_ids,
                kv_handle=kv_handle,
                sampling_params=sampling,
                priority=spec.priority,
            )
            try:
                async with aclosing(self._stream_decode(instance, request, state)) as deltas:
                    async for delta in deltas:
                        yield delta
                if state.finished:
                    return
                raise _NodeGaveUp("stream ended before the request finished")
            except grpc.aio.AioRpcError as exc:
                last_fault = self._on_rpc_error(instance, exc, "decode")
            except _NodeGaveUp as exc:
                logger.warning("decode on %s gave up: %s", instance.address, exc)
                self.registry.mark_failed(instance)
                last_fault = _Fault.TRANSPORT
            failures += 1
            usage.migrations += 1
            logger.info(
                "resuming %s sample %d after %d tokens",
                spec.request_id,
                index,
                len(state.token_ids),
            )
        raise self._exhausted("decode", last_fault, tried)

    async def _stream_decode(
        self, instance: Instance, request: pb.DecodeRequest, state: SampleState
    ) -> AsyncGenerator[SampleDelta, None]:
        call = self.clients.decode(instance.address).Decode(request)
        node_done = False  # the node ended the request itself (final item or end of stream)
        with self.registry.track(instance):
            try:
                while (item := await self._next_item(call)) is not None:
                    node_done = item.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    stop_id = item.stop_token_id if item.HasField("stop_token_id") else None
                    delta = state.push(item.token_ids, item.logprobs, item.finish_reason, stop_id)
                    if delta.token_ids or delta.text or delta.finish_reason:
                        yield delta
                    if state.finished:
                        return
                    if node_done:  # ABORT or ERROR: the caller resumes elsewhere
                        raise _NodeGaveUp(item.error_message or "aborted by the node")
                node_done = True
            finally:
                if not node_done:  # stop string, client gone, stalled or failed node
                    call.cancel()
                    self._abort_later(instance, request.request_id, Role.DECODE)

    async def _next_item(
        self, call: grpc.aio.UnaryStreamCall[pb.DecodeRequest, pb.DecodeResponse]
    ) -> pb.DecodeResponse | None:
        """The stream's next item; None at its end. Raises _NodeGaveUp when it stalls."""
        try:
            item = await asyncio.wait_for(call.read(), self.config.decode_stall_timeout_s)
        except asyncio.TimeoutError:
            raise _NodeGaveUp(f"no output for {self.config.decode_stall_timeout_s:g} s") from None
        return None if item is grpc.aio.EOF else item

    # -- faults ------------------------------------------------------------------------------
    def _on_rpc_error(self, instance: Instance, exc: grpc.aio.AioRpcError, step: str) -> _Fault:
        """Classify a failed call; raise a RouterError when it is the request's own fault."""
        fault = _classify(exc)
        if fault is _Fault.REQUEST:
            raise invalid_request(f"{step} rejected the request: {exc.details()}")
        if fault is _Fault.TRANSPORT:
            self.registry.mark_failed(instance)
        logger.warning(
            "%s on %s failed (%s: %s); trying another instance",
            step,
            instance.address,
            exc.code().name,
            exc.details(),
        )
        return fault

    def _exhausted(self, step: str, last: _Fault | None, tried: set[str]) -> RouterError:
        if last is _Fault.BUSY:
            return overloaded(f"every {step} instance is at capacity; retry later")
        if not tried:
            return no_instance(f"no healthy {step} instance is available")
        if len(tried) > self.config.max_retries:
            return upstream_failure(f"{step} failed on {len(tried)} instances; giving up")
        return no_instance(f"no healthy {step} instance left after {len(tried)} failed")

    def _abort_later(self, instance: Instance, request_id: str, service: Role) -> None:
        """Best-effort Abort on a node's ``service``, in the background (idempotent there)."""
        task = asyncio.get_running_loop().create_task(self._abort(instance, request_id, service))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _abort(self, instance: Instance, request_id: str, service: Role) -> None:
        message = pb.AbortRequest(request_id=request_id)
        try:
            if service is Role.DECODE:
                stub = self.clients.decode(instance.address)
            else:
                stub = self.clients.prefill(instance.address)
            await stub.Abort(message, timeout=_ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.debug("abort of %s on %s failed: %s", request_id, instance.address, exc)

    async def drain_aborts(self) -> None:
        """Wait for background Aborts (at shutdown)."""
        if self._aborts:
            await asyncio.gather(*self._aborts, return_exceptions=True)


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
