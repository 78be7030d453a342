"""A request inside the engine and its status machine.

```
 WAITING ──schedule──▶ RUNNING ──stop/length──▶ FINISHED_STOPPED / FINISHED_LENGTH_CAPPED
   ▲  │                  │
   │  └─▶ WAITING_FOR_REMOTE_KV (load in flight; the scheduler skips it until done)
   └──── PREEMPTED ◀─────┘ (blocks freed, recomputed later)
 any state ──abort──▶ FINISHED_ABORTED
```
"""

from __future__ import annotations

import enum
import time

import msgspec

from common.block_hash import BlockHash, hash_blocks, root_hash
from common.host_kv_tier import SwappedKV
from common.kv_interface import KVHandle
from common.lora.adapter import LoraRef
from common.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self >= _FIRST_FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# a plain int: looking a member up on its enum class costs more than the comparison (per row)
_FIRST_FINISHED = int(RequestStatus.FINISHED_STOPPED)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class TokenLogprobs(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Logprob of a chosen token and the top-k alternatives (ids and logprobs, best first).

    A ``msgspec.Struct``: it travels in every step's output message as a short array."""

    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class Request:
    """Token state of one sequence. Owned by the scheduler; blocks live in the KV cache manager.

    ``num_computed_tokens`` counts tokens whose KV is in the cache or written by a step already
    scheduled (``schedule`` advances it).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_id: int | None,
        block_size: int,
        seed: int,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        lora: LoraRef | None = None,
        max_tokens: int,
        output_token_ids: list[int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.seed = seed  # the random stream's key (sampling_params.seed or drawn at arrival)
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.lora = lora  # the LoRA adapter it runs under (None: the base model)
        self.max_tokens = max_tokens  # resolved: never None here
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = list(output_token_ids or [])
        self.all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.output_logprobs: list[TokenLogprobs] = []
        # per prompt token (None first: nothing precedes it), filled chunk by chunk as the
        # prefill scores them (common/prompt_logprobs.py); None when not asked for
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # sampled by a step still in flight, id not known yet (see common/scheduler.py)
        self.num_output_placeholders = 0
        # draft tokens proposed for the next step (speculative decoding, common/spec_decode/)
        self.spec_token_ids: list[int] = []
        # speculation back-off (``common/spec_decode/rejection.py``): verifications in a row
        # with no draft accepted, and the output count before which no drafts are proposed
        self.spec_misses = 0
        self.spec_lookup_misses = 0  # prompt lookups in a row that found nothing (ngram)
        self.spec_resume_at = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 until scheduled
        self.num_preemptions = 0
        # blocks swapped to the host KV tier at its last preemption (common/host_kv_tier.py)
        self.swapped: SwappedKV | None = None
        self.stop_reason: int | str | None = None
        self.kv_handle: KVHandle | None = None  # set by a producer connector at finish
        self.kv_transfer: KVHandle | None = None  # where this prompt's KV waits (a decode node)
        self.num_external_tokens = 0  # prompt tokens whose KV came through the connector
        self.expected_external_tokens = 0  # what the connector promised to load
        self.waiting_for_grammar = False  # its grammar is compiling: not schedulable yet
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        self.update_block_hashes()

    # -- token bookkeeping ------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status >= _FIRST_FINISHED  # (``status.finished``, one call less per row)

    @property
    def hash_salt(self) -> str | None:
        """What its block hashes are chained from besides the tokens: the cache salt and the
        adapter's identity (name and content), so KV never crosses adapters — not in the
        prefix cache, not in the store, not through a handle."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00lora:{self.lora.identity}"

    def append_output_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        self.update_block_hashes()

    def set_prompt_logprobs(self, first_token: int, items: list[TokenLogprobs]) -> None:
        """Scores of prompt tokens ``first_token, …`` (a recomputed chunk overwrites them)."""
        assert self.prompt_logprobs is not None, "this request asked for no prompt logprobs"
        self.prompt_logprobs[first_token : first_token + len(items)] = items

    def update_block_hashes(self) -> None:
        """Extend ``block_hashes`` to cover every full block of ``all_token_ids``."""
        done = len(self.block_hashes) * self.block_size
        if len(self.all_token_ids) - done < self.block_size:  # most calls: no block filled
            return
        parent = self.block_hashes[-1] if self.block_hashes else root_hash(self.hash_salt)
        self.block_hashes += hash_blocks(
            self.all_token_ids, self.block_size, parent=parent, start=done
        )

    def sort_key(self, policy: str) -> tuple[float, ...]:
        """Order of service: lower first. FCFS: arrival; priority: (priority, arrival)."""
        if policy == "priority":
            return (self.priority, self.arrival_time)
        return (self.arrival_time,)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens},"
            f" out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
