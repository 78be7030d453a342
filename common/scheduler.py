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
request's next step needs its previous token on the host (penalties).

NOTE: ``n > 1``. The engine never sees a request with several samples: the caller splits it into
``n`` requests with the same prompt (``common/parallel_sampling.py``), arriving together. They
share the prompt's KV through the prefix cache, and in one prefill: the first one admitted
registers its full prompt blocks as soon as they are scheduled (KV is written before attention
reads it, in every layer), so its siblings, admitted behind it in the same step, hit every full
block and compute only the last partial one. A prompt longer than the step's budget is chunked by
the first; running requests are served before waiting ones, so a sibling is admitted only once
the first's last chunk leaves budget over, and then hits all of its blocks too. (With prefix
caching off, each sample computes the prompt.)

NOTE: speculative decoding (``common/spec_decode/``). A decoding request holding draft tokens
(``spec_token_ids``, set by the engine's proposer before ``schedule``) is scheduled as its last
token plus the drafts — as many as the budget, ``max_tokens`` and ``max_model_len`` leave — and
samples at every one of those positions. ``update_from_output`` keeps the drafts that equal the
target's samples plus the sample after them, stops inside that run at a stop token or
``max_tokens``, and rolls the rejected drafts' KV back (``num_computed_tokens`` trimmed, blocks
past it freed; only real tokens are ever hashed into the prefix cache).
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from common.config import SchedulerConfig
from common.host_kv_tier import HostTierStats
from common.kv_cache_manager import NO_HIT, ComputedBlocks, KVCacheManager
from common.kv_connector import KVConnectorScheduler
from common.request import Request, RequestStatus, TokenLogprobs
from common.spec_decode.rejection import num_accepted, record_verification
from common.step_outputs import (
    EngineCoreOutput,
    EngineStats,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from common.prompt_logprobs import PromptLogprobsChunk


class _Remote(enum.Enum):
    """What the connector said about a waiting request's prompt."""

    NONE = enum.auto()  # nothing (more) to load: compute it
    PARKED = enum.auto()  # loading: the request waits in WAITING_FOR_REMOTE_KV
    UNKNOWN = enum.auto()  # the store is being asked: try again next step


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
        max_loras: int | None = None,
    ) -> None:
        """``max_loras``: distinct LoRA adapters the running batch may hold (the device's
        adapter slots); None: LoRA is off."""
        self.config = config
        self.max_loras = max_loras
        self.kv = kv_cache_manager
        self.max_model_len = max_model_len
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_scheduled_tokens = 0  # tokens computed over the engine's life (for tests/stats)
        self.loading: dict[str, Request] = {}  # WAITING_FOR_REMOTE_KV, keyed by request id
        self._ended_ids: set[str] = set()  # ended since the worker connector last heard
        self.spec_counts = [0, 0, 0]  # speculative: verifications, drafts, drafts accepted

    # -- admission ---------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.push(request)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        """Queue, batch and cache figures now (between steps)."""
        waiting = [r for r in self.requests.values() if r.status != RequestStatus.RUNNING]
        tier = self.kv.host_tier
        host = tier.stats() if tier is not None else HostTierStats(0, 0, 0)
        return EngineStats(
            num_waiting=len(waiting),
            num_running=len(self.running),
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.pool.num_blocks,
            queued_prompt_tokens=sum(r.num_tokens - r.num_computed_tokens for r in waiting),
            spec_num_drafts=self.spec_counts[0],
            spec_num_draft_tokens=self.spec_counts[1],
            spec_num_accepted_tokens=self.spec_counts[2],
            host_tier_offloaded_blocks=host.offloaded_blocks,
            host_tier_loaded_blocks=host.loaded_blocks,
        )

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            self._schedule_waiting(out, budget)
        out.num_batched_tokens = sum(s.num_new_tokens for s in out.scheduled)
        out.host_copies = self.kv.take_host_copies()
        self.num_scheduled_tokens += out.num_batched_tokens
        if self.connector is not None:
            out.connector_meta = self.connector.build_connector_meta(out)
        for item in out.scheduled:  # their KV is written by this step's forward pass
            item.request.num_computed_tokens += item.num_new_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index, running = 0, self.running  # (``_preempt`` shrinks this very list)
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = min(self._num_schedulable(request), budget)
            if num_new <= 0:  # waits for its output in flight, or stops there
                index += 1
                continue
            drafts = self._take_drafts(request, num_new, budget)
            num_new += len(drafts)
            if not self._allocate_or_preempt(request, index, num_new, out):
                continue  # ``request`` itself was preempted; ``running`` shrank
            self._add_scheduled(out, request, num_new, drafts)
            budget -= num_new
            index += 1
        return budget

    def _num_schedulable(self, request: Request) -> int:
        """Tokens a running request can compute now: its known tokens plus the ones still in
        flight, but nothing past the step that may end it (``max_tokens``, ``max_model_len``)."""
        pending, num_tokens = request.num_output_placeholders, request.num_tokens
        if pending and (
            request.num_output_tokens + pending >= request.max_tokens
            or num_tokens + pending >= self.max_model_len
        ):
            return 0
        return num_tokens + pending - request.num_computed_tokens

    def _take_drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The request's drafts to verify this step (consumed): on a plain decode row only, as
        many as the budget, ``max_tokens`` and ``max_model_len`` leave room for."""
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or num_new != 1 or request.num_output_placeholders:
            return []
        room = min(
            budget - 1,
            request.max_tokens - request.num_output_tokens - 1,
            self.max_model_len - request.num_tokens - 1,
        )
        return drafts[: max(room, 0)]

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
        self.kv.swap_out(request)  # with a host KV tier: what the prefix cache cannot refind
        self.kv.free(request.request_id)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)
        out.preempted_ids.append(request.request_id)

    def roll_back(self, request: Request) -> None:
        """Take ``request`` out of the batch after a step that failed (``common/step_faults``):
        its blocks are freed and it will be recomputed, as after a preemption (its output
        tokens stay), but it is not queued again until :meth:`requeue`. It stays known
        (``requests``), so it can still be aborted."""
        if request in self.running:
            self.running.remove(request)
        self.waiting.remove(request.request_id)
        self.kv.free(request.request_id)
        request.spec_token_ids = []
        request.num_output_placeholders = 0
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED

    def requeue(self, request: Request) -> None:
        """Queue a rolled-back request again."""
        self.waiting.push(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        asking: list[Request] = []  # the store is being asked, or the grammar compiles
        try:
            self._admit_waiting(out, budget, asking)
        finally:
            for request in asking:  # back in their places, for the next step
                self.waiting.push(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, asking: list[Request]) -> None:
        adapters = {r.lora.identity for r in self.running if r.lora is not None}
        while budget > 0:
            request = self.waiting.peek()
            if request is None or request.num_output_placeholders:
                return  # (a request preempted with a token in flight waits for it)
            if len(self.running) >= self.config.max_num_seqs:
                return
            if request.waiting_for_grammar or self._no_slot_for(request, adapters):
                asking.append(self.waiting.pop())  # compiling, or no adapter slot: next one
                continue
            # A request back from a remote load already holds blocks and computed tokens.
            resumed = request.request_id in self.kv.req_to_blocks
            hit = NO_HIT if resumed else self.kv.find_computed_blocks(request)
            if not resumed:
                remote = self._start_remote_load(request, hit)
                if remote is _Remote.PARKED:
                    continue
                if remote is _Remote.UNKNOWN:  # never wait for the store: the next one goes
                    asking.append(self.waiting.pop())
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
            if request.lora is not None:
                adapters.add(request.lora.identity)
            self._add_scheduled(out, request, num_new)
            budget -= num_new

    def _no_slot_for(self, request: Request, adapters: set[str]) -> bool:
        """Its adapter would be one more than the device's slots hold in one step."""
        lora = request.lora
        return (
            lora is not None
            and self.max_loras is not None
            and lora.identity not in adapters
            and len(adapters) >= self.max_loras
        )

    def _start_remote_load(self, request: Request, hit: ComputedBlocks) -> _Remote:
        """Ask the connector for more of the prompt; park the request while it loads."""
        if self.connector is None or request.prompt_logprobs is not None:
            return _Remote.NONE  # (prompt logprobs need the prompt computed here)
        matched = self.connector.get_num_new_matched_tokens(request, hit.num_tokens)
        if matched.num_tokens is None:
            return _Remote.UNKNOWN
        if matched.num_tokens == 0:
            return _Remote.NONE
        # Only asynchronous loads exist here: a loading request always waits in its own state,
        # and its blocks land layer by layer in the forward pass after the fetch.
        assert matched.load_async, "synchronous KV loads are not supported by this scheduler"
        if self.kv.allocate_slots(request, 0, hit, matched.num_tokens) is None:
            return _Remote.NONE  # no room to land it: compute the prompt like any other
        self.waiting.pop()
        self.kv.record_lookup(request, hit)
        request.num_cached_tokens = hit.num_tokens
        request.num_computed_tokens = hit.num_tokens
        request.expected_external_tokens = matched.num_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.loading[request.request_id] = request
        block_ids = self.kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, matched.num_tokens)
        return _Remote.PARKED

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

    def _add_scheduled(
        self, out: SchedulerOutput, request: Request, num_new: int, drafts: list[int] | None = None
    ) -> None:
        kv, request_id, start = self.kv, request.request_id, request.num_computed_tokens
        samples = start + num_new >= request.num_tokens + request.num_output_placeholders
        if samples:
            request.num_output_placeholders += 1
        block_ids = kv.get_block_ids(request_id)
        version = kv.table_version(request_id)
        item = ScheduledRequest(request, num_new, samples, block_ids, start, drafts or [], version)
        out.scheduled.append(item)
        # Blocks become shareable as soon as their tokens are scheduled: KV is written before
        # attention reads it in every layer, so a same-step hit reads valid data.
        kv.cache_blocks(request, start + num_new)

    # -- after the forward pass ---------------------------------------------------------------
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: dict[str, SampledToken],
        verified: dict[str, list[SampledToken]] | None = None,
        prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None,
    ) -> list[EngineCoreOutput]:
        """Apply a step's tokens. ``verified``: the target's samples at every position of the
        requests that verified drafts (``len(drafts) + 1`` each); ``prompt_logprobs``: the
        prompt tokens the step scored, kept on their requests until the first output token."""
        results: list[EngineCoreOutput] = []
        for item in out.scheduled:
            request = item.request
            chunk = prompt_logprobs.get(request.request_id) if prompt_logprobs else None
            if chunk is not None and not request.is_finished:
                request.set_prompt_logprobs(chunk.first_token, chunk.items)
            if not item.samples:
                continue
            request.num_output_placeholders -= 1
            if request.is_finished:  # ended while this step ran: its token is for nobody
                continue
            if item.spec_token_ids:
                assert verified is not None
                results.append(self._accept_verified(item, verified[request.request_id]))
            else:
                results.append(self._accept_tokens(request, (sampled[request.request_id],)))
        return results

    def _accept_verified(
        self, item: ScheduledRequest, targets: list[SampledToken]
    ) -> EngineCoreOutput:
        """Keep the accepted drafts and the target's token after them; roll back the rest."""
        request, drafts = item.request, item.spec_token_ids
        accepted = num_accepted(drafts, [t.token_id for t in targets])
        self.spec_counts[0] += 1
        self.spec_counts[1] += len(drafts)
        self.spec_counts[2] += accepted
        output = self._accept_tokens(request, targets[: accepted + 1])
        record_verification(request, accepted)  # counts from the tokens just emitted
        if not request.is_finished:  # the rejected drafts' KV is garbage: forget it
            request.num_computed_tokens = request.num_tokens - 1
            self.kv.trim(request.request_id, request.num_computed_tokens)
        return output

    def must_sync(self, out: SchedulerOutput) -> bool:
        """Whether the step ``out`` must be finished (its tokens known on the host) before the
        next one is scheduled: a request sampling in it has penalties (they count its output
        tokens) or a grammar (its matcher must accept the token before the next mask)."""
        return any(
            item.samples
            and (
                item.request.sampling_params.needs_penalties
                or item.request.sampling_params.structured_outputs is not None
            )
            for item in out.scheduled
        )

    def _accept_tokens(self, request: Request, tokens: Sequence[SampledToken]) -> EngineCoreOutput:
        """Append ``tokens`` in order, stopping at the first that ends the request."""
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs] = []
        first = request.num_output_tokens == 0
        for token_id, token_logprobs in tokens:
            request.append_output_token(token_id, token_logprobs)
            token_ids.append(token_id)
            if token_logprobs is not None:
                logprobs.append(token_logprobs)
            status = self._check_stop(request, token_id)
            if status is not None:
                self._finish(request, status)
                break
        return EngineCoreOutput(
            request.request_id,
            token_ids,
            logprobs,
            request.status.finish_reason,
            request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            kv_handle=request.kv_handle,
            num_external_tokens=request.num_external_tokens,
            prompt_logprobs=request.prompt_logprobs if first else None,
        )

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params, num_output = request.sampling_params, request.num_output_tokens
        if num_output >= params.min_tokens:
            if token_id == request.eos_token_id and not params.ignore_eos:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if num_output >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # -- finishing and aborting --------------------------------------------------------------
    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests in any state (stop strings, aborts), freeing their blocks."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                self._finish(request, status)

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
