"""Continuous batching with one token budget per step.

NOTE: the scheduling idea (vLLM v1's). There are no "prefill steps" and "decode steps": every
request simply has ``num_computed_tokens`` and ``num_tokens``, and each step the scheduler hands
out at most ``max_num_batched_tokens`` new tokens. Running requests go first (a decode costs one
token, a partially prefilled prompt continues with the next chunk), then waiting requests are
admitted in policy order while the budget, ``max_num_seqs`` and free blocks last. A prompt longer
than what is left of the budget is chunked, so long prefills mix with decodes in the same batch
instead of stalling them. Prefix-cache hits count as computed and cost no budget.

When a running request cannot get a block, the lowest-priority running request (the newest under
FCFS) is preempted: its blocks are freed and it goes back to waiting, to be recomputed later (its
prefix is likely still cached). A request alone always fits, because the engine checks at start-up
that the cache holds ``max_model_len`` tokens; so this never deadlocks.

NOTE: scheduling ahead (the engine's overlapped loop). ``schedule()`` counts a step's tokens as
computed when it hands them out, and a token the step will sample as an *output placeholder*
until ``update_from_output`` learns its id. So step N+1 can be scheduled while step N still runs:
a decoding request whose next token is still on the device simply gets one more token (the model
runner takes its id from step N's sampled tensor). What cannot be known ahead stays exact: a
request that stops at step N has its step N+1 row dropped (the runner computed one token for
nobody), one at ``max_tokens`` is not scheduled ahead, and ``must_sync`` tells the engine when a
request's next step needs its previous token on the host (penalties, a pending fork into ``n``).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.config import SchedulerConfig
from common.kv_cache_manager import NO_HIT, ComputedBlocks, KVCacheManager
from common.kv_connector import ConnectorMetadata, KVConnectorScheduler, KVHandle
from common.request import Request, RequestStatus, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One request's share of a step. ``num_samples`` > 0 when this step yields its next token
    (``n`` first tokens for a request about to fork into ``n`` samples)."""

    request: Request
    num_new_tokens: int
    num_samples: int
    block_ids: list[int]  # the request's whole block table after this step's allocation
    num_computed_tokens: int  # tokens in the cache before this step: where its tokens start


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before forward
    preempted_ids: list[str] = field(default_factory=list)
    connector_meta: ConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledTokens:
    """What the model runner returns for one scheduled request with ``num_samples`` > 0."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class EngineCoreOutput:
    """Progress of one request after a step (new tokens, and the finish reason if it ended)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    parent_id: str | None = None  # set on the first output of a forked sample
    num_cached_tokens: int = 0
    kv_handle: KVHandle | None = None  # producer: where the prompt's KV now lives
    num_external_tokens: int = 0  # prompt tokens loaded through the connector


class WaitingQueue:
    """Requests ordered by policy (FCFS: arrival; priority: (priority, arrival)). Lazy deletes."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._heap: list[tuple[tuple[float, ...], int, Request]] = []
        self._ids: set[str] = set()
        self._counter = itertools.count()

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key(self.policy), next(self._counter), request))
        self._ids.add(request.request_id)

    def peek(self) -> Request | None:
        while self._heap and self._heap[0][2].request_id not in self._ids:
            heapq.heappop(self._heap)
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        request = self.peek()
        assert request is not None
        heapq.heappop(self._heap)
        self._ids.discard(request.request_id)
        return request

    def remove(self, request_id: str) -> None:
        self._ids.discard(request_id)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache_manager: KVCacheManager,
        max_model_len: int,
        connector: KVConnectorScheduler | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self._fork_children: dict[str, list[Request]] = {}  # parent id → samples 2..n
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # tokens computed over the engine's life (for tests/stats)
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, keyed by request id
        self._ended_ids: set[str] = set()  # ended since the worker connector last heard

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, request: Request, children: Iterable[Request] = ()) -> None:
        """Queue a request; ``children`` are its samples 2..n, forked once its prompt is done."""
        self.requests[request.request_id] = request
        kids = list(children)
        if kids:
            self._fork_children[request.request_id] = kids
            request.child_seeds = [child.seed for child in kids]
        self.waiting.push(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        self.num_scheduled_tokens += out.num_batched_tokens
        out.block_copies = self.kv.take_block_copies()
        if self.connector is not None:
            out.connector_meta = self.connector.build_connector_meta(out)
        for item in out.scheduled:  # their KV is written by this step's forward pass
            item.request.num_computed_tokens += item.num_new_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._num_schedulable(request), budget)
            if num_new <= 0:  # waits for its output in flight, or stops there
                index += 1
                continue
            if not self._allocate_or_preempt(request, index, num_new, out):
                continue  # ``request`` itself was preempted; ``running`` shrank
            self._add_scheduled(out, request, num_new)
            budget -= num_new
            index += 1
        return budget

    def _num_schedulable(self, request: Request) -> int:
        """Tokens a running request can compute now: its known tokens plus the ones still in
        flight, but nothing past the step that may end it (``max_tokens``, ``max_model_len``)."""
        pending = request.num_output_placeholders
        if pending and (
            request.num_output_tokens + pending >= request.max_tokens
            or request.num_tokens + pending >= self.max_model_len
        ):
            return 0
        return request.num_tokens + pending - request.num_computed_tokens

    def _allocate_or_preempt(
        self, request: Request, index: int, num_new: int, out: SchedulerOutput
    ) -> bool:
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self._pick_victim(index)
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _pick_victim(self, index: int) -> Request:
        """Lowest-priority request not yet scheduled this step (``running[index:]``)."""
        if self.config.policy == "priority":
            return max(self.running[index:], key=lambda r: r.sort_key("priority"))
        return self.running[-1]

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)
        out.preempted_ids.append(request.request_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while budget > 0:
            request = self.waiting.peek()
            if request is None or request.num_output_placeholders:
                return  # (a request preempted with a token in flight waits for it)
            seats = 1 + len(self._fork_children.get(request.request_id, ()))
            if self._seats_taken() + seats > self.config.max_num_seqs:
                return  # its n samples will all run: ``max_num_seqs`` bounds every step
            # A request back from a remote load already holds blocks and computed tokens.
            resumed = request.request_id in self.kv.req_to_blocks
            hit = NO_HIT if resumed else self.kv.find_computed_blocks(request)
            if not resumed and self._start_remote_load(request, hit):
                continue
            computed = request.num_computed_tokens if resumed else hit.num_tokens
            num_new = request.num_tokens - computed
            if num_new > budget and not self.config.enable_chunked_prefill:
                return
            num_new = min(num_new, budget)
            if self.kv.allocate_slots(request, num_new, hit) is None:
                return  # wait for blocks; admitting later requests first would starve this one
            self.waiting.pop()
            if not resumed:
                self.kv.record_lookup(request, hit)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = hit.num_tokens
                request.num_computed_tokens = hit.num_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._add_scheduled(out, request, num_new)
            budget -= num_new

    def _seats_taken(self) -> int:
        """Running requests, plus the samples running parents will fork into."""
        forks = sum(
            len(kids)
            for parent_id, kids in self._fork_children.items()
            if self.requests[parent_id].status == RequestStatus.RUNNING
        )
        return len(self.running) + forks

    def _start_remote_load(self, request: Request, hit: ComputedBlocks) -> bool:
        """Ask the connector for more of the prompt; park the request while it loads.

        Returns True when the request left the waiting queue for ``WAITING_FOR_REMOTE_KV``.
        """
        if self.connector is None:
            return False
        matched = self.connector.get_num_new_matched_tokens(request, hit.num_tokens)
        if matched.num_tokens == 0:
            return False
        # Only asynchronous loads exist here: a loading request always waits in its own state,
        # and its blocks land layer by layer in the forward pass after the fetch.
        assert matched.load_async, "synchronous KV loads are not supported by this scheduler"
        if self.kv.allocate_slots(request, 0, hit, matched.num_tokens) is None:
            return False  # no room to land it: compute the prompt like any other
        self.waiting.pop()
        self.kv.record_lookup(request, hit)
        request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        request.expected_external_tokens = matched.num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = request
        block_ids = self.kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, matched.num_tokens)
        return True

    def update_from_connector(self, done_loading: set[str], failed_blocks: set[int]) -> None:
        """Finished loads go back to waiting with what arrived counted as computed; a failed
        block and everything after it is recomputed."""
        for request_id in done_loading:
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            block_ids = self.kv.get_block_ids(request_id)
            first = request.num_computed_tokens // self.kv.block_size
            loaded = self._loaded_tokens(request, block_ids[first:], failed_blocks)
            request.num_external_tokens = loaded
            request.num_computed_tokens += loaded
            self.kv.cache_blocks(request, request.num_computed_tokens)
            request.status = RequestStatus.WAITING
            self.waiting.push(request)

    def _loaded_tokens(self, request: Request, block_ids: list[int], failed: set[int]) -> int:
        """Tokens of the load range up to the first failed block (prompt tokens only)."""
        limit = request.num_prompt_tokens - request.num_computed_tokens
        limit = min(limit, request.num_tokens - 1 - request.num_computed_tokens)
        loaded = 0
        for block_id in block_ids:
            if block_id in failed or loaded >= limit:
                break
            loaded += self.kv.block_size
        return min(loaded, request.expected_external_tokens, limit)

    def take_ended_ids(self) -> set[str]:
        ended, self._ended_ids = self._ended_ids, set()
        return ended

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        done = start + num_new >= request.num_tokens + request.num_output_placeholders
        num_samples = 0
        if done:
            num_samples = 1 + len(self._fork_children.get(request.request_id, ()))
            request.num_output_placeholders += 1
        block_ids = self.kv.get_block_ids(request.request_id)
        out.scheduled.append(ScheduledRequest(request, num_new, num_samples, block_ids, start))
        # Blocks become shareable as soon as their tokens are scheduled: KV is written before
        # attention reads it in every layer, so a same-step hit reads valid data.
        self.kv.cache_blocks(request, request.num_computed_tokens + num_new)

    # -- after the forward pass ---------------------------------------------------------------
    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, SampledTokens]
    ) -> list[EngineCoreOutput]:
        results: list[EngineCoreOutput] = []
        for item in out.scheduled:
            request = item.request
            if item.num_samples == 0:
                continue
            request.num_output_placeholders -= 1
            if request.is_finished:  # ended while this step ran: its token is for nobody
                continue
            tokens = sampled[request.request_id]
            results.append(self._accept_token(request, tokens.token_ids[0], tokens, 0))
            for i, child in enumerate(self._fork(request), start=1):
                result = self._accept_token(child, tokens.token_ids[i], tokens, i)
                result.parent_id = request.request_id
                results.append(result)
        return results

    def must_sync(self, out: SchedulerOutput) -> bool:
        """Whether the step ``out`` must be finished (its tokens known on the host) before the
        next one is scheduled: a request sampling in it has penalties (they count its output
        tokens) or forks into its ``n`` samples when it ends."""
        return any(
            item.num_samples
            and (
                item.request.sampling_params.needs_penalties
                or item.request.request_id in self._fork_children
            )
            for item in out.scheduled
        )

    def _fork(self, parent: Request) -> list[Request]:
        children = self._fork_children.pop(parent.request_id, [])
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.status = RequestStatus.RUNNING
            self.kv.fork(parent.request_id, child.request_id)
            self.requests[child.request_id] = child
            self.running.append(child)
        return children

    def _accept_token(
        self, request: Request, token_id: int, tokens: SampledTokens, index: int
    ) -> EngineCoreOutput:
        logprobs = tokens.logprobs[index] if tokens.logprobs else None
        request.append_output_token(token_id, logprobs)
        status = self._check_stop(request, token_id)
        if status is not None:
            self._finish(request, status)
        return EngineCoreOutput(
            request.request_id,
            [token_id],
            [logprobs] if logprobs else [],
            request.status.finish_reason,
            request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            kv_handle=request.kv_handle,
            num_external_tokens=request.num_external_tokens,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # -- finishing and aborting --------------------------------------------------------------
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests in any state (stop strings, aborts), freeing their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)
            for child in self._fork_children.pop(request_id, []):
                child.status = status

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        if request in self.running:
            self.running.remove(request)
        self.waiting.remove(request.request_id)
        self.loading.pop(request.request_id, None)
        if self.connector is not None:
            block_ids = self.kv.get_block_ids(request.request_id)
            _, request.kv_handle = self.connector.request_finished(request, block_ids)
            self._ended_ids.add(request.request_id)
        self.kv.free(request.request_id)
        del self.requests[request.request_id]

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        holders = set(self.kv.req_to_blocks)
        assert holders <= {r.request_id for r in self.running} | set(self.loading), holders
