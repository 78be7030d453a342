"""What a step produces, below the behaviour that produces it: the scheduler's plan for a step
(``SchedulerOutput`` of ``ScheduledRequest`` shares), the runner's ``SampledToken`` per sampling
request, and the engine's per-request ``EngineCoreOutput`` and ``EngineStats``.

Plain data: the scheduler builds the plan, the model runner reads it, the engine turns samples
into outputs; engine-core messages carry the two ``msgspec.Struct``s as they are. Nothing here
imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from common.host_kv_tier import HostCopies
from common.kv_interface import ConnectorMetadata, KVHandle
from common.request import Request, TokenLogprobs


@dataclass
class ScheduledRequest:
    """One request's share of a step. ``samples`` when this step yields its next token."""

    request: Request
    num_new_tokens: int
    samples: bool
    block_ids: list[int]  # the request's whole block table after this step's allocation
    num_computed_tokens: int  # tokens in the cache before this step: where its tokens start
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified in this step
    # the KV cache manager's version of ``block_ids`` (``common/kv_cache_manager.py``): the
    # runner copies only the ids past the ones it holds while it stays; None: copy them all
    block_table_version: int | None = None


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_ids: list[str] = field(default_factory=list)
    connector_meta: ConnectorMetadata | None = None
    # set by the engine after ``schedule``: the step's grammar bitmask (a host tensor, one row
    # per sampling row; common/structured_output.py). The scheduler never reads it.
    grammar_bitmask: object | None = None
    # copies between the device cache and the host KV tier, run before anything else of the
    # step (``common/host_kv_tier.py``)
    host_copies: HostCopies | None = None

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SampledToken(NamedTuple):
    """What the model runner returns for one scheduled request that ``samples``."""

    token_id: int
    logprobs: TokenLogprobs | None = None


class EngineCoreOutput(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Progress of one request after a step (new tokens, and the finish reason if it ended).

    A ``msgspec.Struct``: a step's outputs travel to the frontend as they are, as short arrays."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_handle: KVHandle | None = None  # producer: where the prompt's KV now lives
    num_external_tokens: int = 0  # prompt tokens loaded through the connector
    # with the first output token of a request that asked for them: one per prompt token
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class EngineStats(msgspec.Struct, forbid_unknown_fields=True):
    """The engine's load between two steps (what a node reports to its router; the engine
    core's ``LoadStats`` reply is these fields and a query id)."""

    num_waiting: int  # waiting or preempted, plus those waiting for a KV load
    num_running: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prompt_tokens: int  # prompt tokens of waiting requests still to compute
    # speculative decoding, over the engine's life: verifications, drafts, drafts accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # the host KV tier (``--kv-offload-gb``), over the engine's life: blocks copied out on
    # eviction, blocks copied back for prefix hits
    host_tier_offloaded_blocks: int = 0
    host_tier_loaded_blocks: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 with no drafts)."""
        return self.spec_num_accepted_tokens / max(self.spec_num_draft_tokens, 1)

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted drafts per draft run (vLLM's)."""
        return 1.0 + self.spec_num_accepted_tokens / max(self.spec_num_drafts, 1)

    @property
    def kv_usage(self) -> float:
        """Used / total blocks, in [0, 1]."""
        return (self.num_total_blocks - self.num_free_blocks) / self.num_total_blocks
