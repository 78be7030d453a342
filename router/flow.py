"""The request flow: prefill (retried elsewhere on failure), first token out, decode stream
(migrated elsewhere when its node dies or stalls), detokenization, stop strings, finish.

NOTE on faults. Failures are classified by gRPC status code (``_classify``):

- *transport* (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED by the peer, UNKNOWN, INTERNAL) — the
  instance died or misbehaved: it is marked suspect (balancers skip it for a cooldown) and the
  step is retried on another instance, at most ``max_retries`` times per step;
- *busy* (RESOURCE_EXHAUSTED) — the instance is full: try another; if every candidate is full
  the client gets 429 / RESOURCE_EXHAUSTED;
- *failed* (ABORTED) — the request failed inside the node's engine, which goes on serving:
  the request's own doing, never retried (500 ``request_failed`` to the client);
- anything else (INVALID_ARGUMENT, …) is the request's fault and goes back to the client.

An instance that fails while running a request counts against that request
(``router.quarantine``): after ``quarantine_after`` distinct instances since it last finished, it
is refused, with its resends, and never falls back to a decode node, so one request that kills
engines cannot walk the pool.

A prefill that fails before its first token cannot have sent anything, so retrying it elsewhere
duplicates nothing. When no prefill path is left (no healthy instance, or every attempt failed)
the sample falls back to a decode-only run (``FlowConfig.prefill_fallback``): a Decode with no
handle and no tokens, which the decode node prefills itself; every instance busy stays a 429.

A node that stalls (its engine loop stands still while it holds requests) or goes silent is
*lost* to the registry: its calls give up at once, and a decode stream with no token for the
per-token deadline gives up too (``router.deadlines``); both count as transport faults.

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
import dataclasses
import enum
import functools
import logging
import secrets
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.convert import finish_reason_from_proto, prompt_logprobs_from_proto

from common.beam_search import BeamSearchParams
from common.block_hash import hash_blocks
from common.sampling_params import SamplingParams
from router.balancer import DecodePolicy, PrefillPolicy, PromptInfo
from router.beams import beam_search
from router.deadlines import DecodeItems, NodeLost, until_lost
from router.errors import (
    RouterError,
    invalid_request,
    no_instance,
    overloaded,
    request_failed,
    upstream_failure,
)
from router.merge import merged
from router.node_clients import NodeClients
from router.quarantine import Quarantine
from router.registry import Instance, Registry, Role
from router.sample import SampleDelta, SampleState, sample_seed, to_proto_sampling

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class FlowConfig:
    """Retry budget and timeouts.

    ``progress_timeout_s`` is a decode stream's per-token deadline: with no item for that long
    the request resumes on another node, unless its node is live and full (the request may be
    queued); ``decode_stall_timeout_s`` caps even that wait (``router.deadlines``). A node the
    registry loses (stalled, silent) gives up every call on it at once.
    ``prefill_fallback``: when no prefill instance can give a sample its first
    token (none healthy, or every attempt failed before one), a decode node runs the whole
    request (it prefills locally, slower, same tokens) instead of the client getting an error.
    """

    max_retries: int = 3
    prefill_timeout_s: float = 300.0
    decode_stall_timeout_s: float = 300.0
    prefill_fallback: bool = True  # no prefill path: a decode node prefills locally
    quarantine_after: int = 3  # instances a request may fail before it is refused
    quarantine_s: float = 600.0
    progress_timeout_s: float = 10.0  # per-token deadline of a decode stream

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        if self.quarantine_after < 1 or self.quarantine_s <= 0:
            raise ValueError("need quarantine_after >= 1 and quarantine_s > 0")
        timeouts = (self.prefill_timeout_s, self.decode_stall_timeout_s, self.progress_timeout_s)
        if min(timeouts) <= 0:
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
    prefill_only: bool = False  # max_tokens=0: the prompt's logprobs, no output token
    beam: BeamSearchParams | None = None  # a beam search (router/beams.py): params.n returned
    lora_name: str = ""  # the LoRA adapter it runs under (the request's ``model``); "": base
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))

    def upstream_id(self, index: int, step: str) -> str:
        return f"{self.request_id}-{self.nonce}-{index}-{step}"

    @functools.cached_property
    def fault_key(self) -> bytes:
        """What the quarantine knows the request by (``Quarantine.key``)."""
        return Quarantine.key(self.prompt_token_ids, self.params)


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
    FAILED = "failed"  # the request failed in the node's engine (which goes on)


def _classify(exc: grpc.aio.AioRpcError) -> _Fault:
    code = exc.code()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return _Fault.BUSY
    if code == grpc.StatusCode.ABORTED:
        return _Fault.FAILED
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return _Fault.REQUEST
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        return _Fault.REQUEST
    return _Fault.TRANSPORT


class _NodeGaveUp(Exception):
    """A node ended a request it should have finished (ABORT/ERROR, or a truncated stream)."""


class DecodeAttempts:
    """The decode instances one piece of a request tries in turn (a sample's stream, or a
    beam search's rounds): each untried, healthy one the policy chooses (``pinned``: keep the
    one that served so far), at most ``max_retries`` failures; a failure is judged as every
    decode failure is (``failed``), and ``exhausted`` says why none is left."""

    def __init__(self, flow: RequestFlow, spec: GenerateSpec, usage: Usage, tried: set[str]):
        self.flow, self.spec, self.usage, self.tried = flow, spec, usage, tried
        self.failures = 0
        self.last: _Fault | None = None

    def next(self, pinned: Instance | None = None) -> Instance | None:
        """The instance to try now (None: out of options: raise ``exhausted()``)."""
        if self.failures > self.flow.config.max_retries:
            return None
        if pinned is not None:
            return pinned
        candidates = self.flow.registry.candidates(
            Role.DECODE, frozenset(self.tried), self.spec.lora_name
        )
        if not candidates:
            return None
        prompt = PromptInfo(len(self.spec.prompt_token_ids), (), 0)  # decode has no affinity
        instance = self.flow.decode_policy.choose(candidates, prompt)
        self.tried.add(instance.instance_id)
        return instance

    def failed(self, instance: Instance, exc: BaseException) -> None:
        """``instance`` failed this attempt with ``exc`` (a failed call, a node that gave up,
        one lost or past its deadline); raises RouterError when the request itself is to
        blame or is now quarantined."""
        flow = self.flow
        if isinstance(exc, grpc.aio.AioRpcError):
            self.last = flow._on_rpc_error(self.spec, instance, exc, "decode")
        else:
            logger.warning("decode on %s gave up: %s", instance.address, exc)
            flow.registry.gave_up_on(instance)
            self.last = flow._failed_on(self.spec, instance)
        self.failures += 1
        self.usage.migrations += 1

    def exhausted(self) -> RouterError:
        return self.flow._exhausted("decode", self.last, self.tried)


# what a decode attempt that failed on its node raises (DecodeAttempts.failed judges them)
DECODE_FAILURES = (grpc.aio.AioRpcError, _NodeGaveUp, NodeLost)


class _NoPrefillPath(Exception):
    """No prefill instance gave the sample its first token. ``reason``: ``"no_prefill"`` (none
    was healthy) or ``"prefill_failed"`` (every attempt failed first); ``error`` is what the
    client gets when the request cannot fall back to a decode node."""

    def __init__(self, reason: str, error: RouterError) -> None:
        super().__init__(error.message)
        self.reason = reason
        self.error = error


class RequestFlow:
    """Runs requests across the pools. Shared by the HTTP and gRPC front doors.

    Owns nothing it is given; keeps only the set of background Abort tasks. ``on_fallback``
    is told each time a sample falls back to a decode-only run (the metrics count it).
    """

    def __init__(
        self,
        registry: Registry,
        clients: NodeClients,
        tokenizer: object,
        prefill_policy: PrefillPolicy,
        decode_policy: DecodePolicy,
        config: FlowConfig,
        on_fallback: Callable[[str], None] = lambda reason: None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self.registry = registry
        self.clients = clients
        self.tokenizer = tokenizer
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.config = config
        self.on_fallback = on_fallback  # called with the reason of each prefill fallback
        self.eos_token_ids = list(eos_token_ids)  # where a beam ends
        self.quarantine = Quarantine(config.quarantine_after, config.quarantine_s)
        self._aborts: set[asyncio.Task[None]] = set()

    def prompt_info(self, token_ids: list[int], lora_name: str = "") -> PromptInfo:
        """The prompt's length and its block hashes in the pool's block size (none while the
        router knows no node: there is nothing to be affine to). Under an adapter the hashes
        are salted with its name: its KV is not the base model's (the nodes key it by name and
        content; affinity only needs the name)."""
        size = self.registry.block_size()
        salt = f"lora:{lora_name}" if lora_name else None
        hashes = hash_blocks(token_ids, size, salt) if size else []
        return PromptInfo(len(token_ids), hashes, size or 0)

    async def generate(self, spec: GenerateSpec, usage: Usage) -> AsyncGenerator[SampleDelta, None]:
        """Every sample's deltas, interleaved; ``usage`` is filled in as the request runs.

        Raises RouterError. Closing the iterator (or cancelling its consumer) aborts upstream.
        """
        usage.prompt_tokens = len(spec.prompt_token_ids)
        self.quarantine.check(spec.fault_key)
        if spec.beam is not None:
            async with aclosing(beam_search(self, spec, usage)) as hypotheses:
                async for delta in hypotheses:
                    yield delta
        else:
            prompt = self.prompt_info(spec.prompt_token_ids, spec.lora_name)
            samples = [self._sample(spec, i, prompt, usage) for i in range(spec.params.n)]
            # aclosing: closing this generator must close the inner ones at once (cancel upstream)
            async with aclosing(merged(samples)) as deltas:
                async for delta in deltas:
                    yield delta
        # served whole (not closed early, no RouterError): its past failures were not its doing
        self.quarantine.succeeded(spec.fault_key)

    async def _sample(
        self, spec: GenerateSpec, index: int, prompt: PromptInfo, usage: Usage
    ) -> AsyncGenerator[SampleDelta, None]:
        assert spec.params.seed is not None, "the router always sets a seed"
        sampling = to_proto_sampling(spec.params, sample_seed(spec.params.seed, index))
        state = SampleState(index, self.tokenizer, spec.prompt_token_ids, spec.params)
        response = await self._prefill_or_fallback(spec, index, sampling, prompt, usage)
        if response is None:  # the decode node prefills: it streams the first token too
            async with aclosing(self._decode(spec, index, sampling, None, state, usage)) as rest:
                async for delta in rest:
                    yield delta
            return
        if index == 0:
            usage.cached_tokens = response.num_cached_tokens
        prompt_logprobs = prompt_logprobs_from_proto(response)
        if spec.prefill_only:  # max_tokens=0: the prompt is scored, its sampled token dropped
            yield SampleDelta(index, [], "", [], "length", None, prompt_logprobs)
            return
        stop_id = response.stop_token_id if response.HasField("stop_token_id") else None
        logprobs = [response.first_logprob] if response.HasField("first_logprob") else []
        finish = finish_reason_from_proto(response.finish_reason)  # None when handed off
        delta = state.push([response.first_token_id], logprobs, finish, stop_id)
        if prompt_logprobs is not None:
            delta = dataclasses.replace(delta, prompt_logprobs=prompt_logprobs)
        usage.completion_tokens += len(delta.token_ids)
        yield delta
        if state.finished:
            return
        # No handle (the prefill node had none to give): the decode node recomputes the prompt.
        handle = response.kv_handle if response.HasField("kv_handle") else None
        async with aclosing(self._decode(spec, index, sampling, handle, state, usage)) as rest:
            async for delta in rest:
                yield delta

    # -- prefill -----------------------------------------------------------------------------
    async def _prefill_or_fallback(
        self,
        spec: GenerateSpec,
        index: int,
        sampling: pb.SamplingParams,
        prompt: PromptInfo,
        usage: Usage,
    ) -> pb.PrefillResponse | None:
        """The prefill's reply, or None when the sample falls back to a decode-only run (no
        prefill path, fallback on, a decode instance available). Raises RouterError."""
        try:
            return await self._prefill(spec, index, sampling, prompt, usage)
        except _NoPrefillPath as exc:
            # prompt logprobs come from a prefill node only
            scoring = spec.prefill_only or spec.params.prompt_logprobs is not None
            fallback = self.config.prefill_fallback and not scoring
            if not fallback or not self.registry.candidates(Role.DECODE, lora=spec.lora_name):
                raise exc.error from None
            logger.info("%s sample %d: %s; a decode node prefills", spec.request_id, index, exc)
            self.on_fallback(exc.reason)
            return None

    async def _prefill(
        self,
        spec: GenerateSpec,
        index: int,
        sampling: pb.SamplingParams,
        prompt: PromptInfo,
        usage: Usage,
    ) -> pb.PrefillResponse:
        """Prefill on the best instance, retrying elsewhere on transport faults or busy.

        Raises RouterError (the request's fault; every instance busy) or _NoPrefillPath."""
        tried: set[str] = set()
        last_fault: _Fault | None = None
        for attempt in range(self.config.max_retries + 1):
            candidates = self.registry.candidates(Role.PREFILL, frozenset(tried), spec.lora_name)
            if not candidates:
                break
            instance = self.prefill_policy.choose(candidates, prompt)
            tried.add(instance.instance_id)
            request = pb.PrefillRequest(
                request_id=spec.upstream_id(index, f"p{attempt}"),
                prompt_token_ids=spec.prompt_token_ids,
                sampling_params=sampling,
                priority=spec.priority,
                lora_name=spec.lora_name,
            )
            try:
                response = await self._call_prefill(instance, request, prompt.num_tokens)
            except grpc.aio.AioRpcError as exc:
                last_fault = self._on_rpc_error(spec, instance, exc, "prefill")
                usage.retries += 1
                continue
            except (_NodeGaveUp, NodeLost) as exc:
                logger.warning("prefill on %s gave up: %s", instance.address, exc)
                last_fault = self._failed_on(spec, instance)
                usage.retries += 1
                continue
            return response
        error = self._exhausted("prefill", last_fault, tried)
        if last_fault is _Fault.BUSY:
            raise error
        raise _NoPrefillPath("prefill_failed" if tried else "no_prefill", error)

    async def _call_prefill(
        self, instance: Instance, request: pb.PrefillRequest, num_tokens: int
    ) -> pb.PrefillResponse:
        stub = self.clients.prefill(instance.address)
        with self.registry.track(instance, num_tokens):
            call = stub.Prefill(request, timeout=self.config.prefill_timeout_s)
            try:
                response = await until_lost(instance, call)
            except BaseException as exc:
                if isinstance(exc, (asyncio.CancelledError, NodeLost)) or _timed_out(exc):
                    self._abort_later(instance, request.request_id, Role.PREFILL)
                raise
        reason = response.finish_reason
        if reason in (pb.FINISH_REASON_ABORT, pb.FINISH_REASON_ERROR):
            raise _NodeGaveUp(response.error_message or "aborted")
        if reason not in (
            pb.FINISH_REASON_HANDED_OFF,
            pb.FINISH_REASON_STOP,
            pb.FINISH_REASON_LENGTH,
        ):
            raise _NodeGaveUp(f"prefill ended with {pb.FinishReason.Name(reason)}")
        return response

    # -- decode ------------------------------------------------------------------------------
    async def _decode(
        self,
        spec: GenerateSpec,
        index: int,
        sampling: pb.SamplingParams,
        kv_handle: pb.KVHandle | None,
        state: SampleState,
        usage: Usage,
    ) -> AsyncGenerator[SampleDelta, None]:
        """Stream from a decode instance (tokens counted in ``usage``); when it fails, resume on
        another from the tokens already sent (none yet, and no handle: a prefill fallback, the node runs it all).
        Ends when the sample finishes; raises RouterError when out of options."""
        attempts = DecodeAttempts(self, spec, usage, set())
        while (instance := attempts.next()) is not None:
            request = pb.DecodeRequest(
                request_id=spec.upstream_id(index, f"d{attempts.failures}"),
                prompt_token_ids=spec.prompt_token_ids,
                output_token_ids=state.token_ids,
                kv_handle=kv_handle,
                sampling_params=sampling,
                priority=spec.priority,
                lora_name=spec.lora_name,
            )
            try:
                async with aclosing(self._stream_decode(instance, request, state)) as deltas:
                    async for delta in deltas:
                        usage.completion_tokens += len(delta.token_ids)
                        yield delta
                if state.finished:
                    return
                raise _NodeGaveUp("stream ended before the request finished")
            except DECODE_FAILURES as exc:
                attempts.failed(instance, exc)
            logger.info(
                "resuming %s sample %d after %d tokens",
                spec.request_id,
                index,
                len(state.token_ids),
            )
        raise attempts.exhausted()

    async def _stream_decode(
        self, instance: Instance, request: pb.DecodeRequest, state: SampleState
    ) -> AsyncGenerator[SampleDelta, None]:
        call = self.clients.decode(instance.address).Decode(request)
        items = DecodeItems(
            call,
            instance,
            lambda: self.registry.live_and_full(instance),
            self.config.progress_timeout_s,
            self.config.decode_stall_timeout_s,
        )
        node_done = False  # the node ended the request itself (final item or end of stream)
        with self.registry.track(instance):
            try:
                while (item := await items.next()) is not None:
                    finish = finish_reason_from_proto(item.finish_reason)
                    node_done = finish is not None
                    stop_id = item.stop_token_id if item.HasField("stop_token_id") else None
                    delta = state.push(item.token_ids, item.logprobs, finish, stop_id)
                    if delta.token_ids or delta.text or delta.finish_reason:
                        yield delta
                    if state.finished:
                        return
                    if node_done:  # ABORT or ERROR: the caller resumes elsewhere
                        raise _NodeGaveUp(item.error_message or "aborted by the node")
                node_done = True
            finally:
                items.close()
                if not node_done:  # stop string, client gone, stalled or failed node
                    call.cancel()
                    self._abort_later(instance, request.request_id, Role.DECODE)

    # -- faults ------------------------------------------------------------------------------
    def _on_rpc_error(
        self, spec: GenerateSpec, instance: Instance, exc: grpc.aio.AioRpcError, step: str
    ) -> _Fault:
        """Classify a failed call; raise a RouterError when it is the request's own fault (or
        it has now failed too many instances)."""
        fault = _classify(exc)
        if fault is _Fault.REQUEST:
            raise invalid_request(f"{step} rejected the request: {exc.details()}")
        if fault is _Fault.FAILED:
            logger.warning("%s on %s: %s", step, instance.address, exc.details())
            raise request_failed(f"{step} failed: {exc.details()}")
        if fault is _Fault.TRANSPORT:
            self.registry.mark_failed(instance)
            if _ran_it(exc):
                self._failed_on(spec, instance)
        logger.warning(
            "%s on %s failed (%s: %s); trying another instance",
            step,
            instance.address,
            exc.code().name,
            exc.details(),
        )
        return fault

    def _failed_on(self, spec: GenerateSpec, instance: Instance) -> _Fault:
        """``instance`` failed while running ``spec``: counted against the request, which is
        refused (RouterError) once quarantined. A draining node ending its streams is leaving,
        not failing: nothing is counted."""
        if not instance.load.draining:
            self.quarantine.failed(spec.fault_key, instance.instance_id)
        self.quarantine.check(spec.fault_key)
        return _Fault.TRANSPORT

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


def _ran_it(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a transport fault may be the request's doing: not when the call never reached
    a node that could run it (nothing listening, or a node refusing it at the door while it
    starts or drains), which the quarantine must not count against the request."""
    details = exc.details() or ""
    refused = ("failed to connect", "node is draining", "node is not ready")
    return not (exc.code() == grpc.StatusCode.UNAVAILABLE and details.startswith(refused))


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
