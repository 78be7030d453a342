"""What a node tells the router about itself, as plain Python types: its ``Role``, what it serves
(``NodeInfo``) and how busy it is (``NodeLoad``).

These are the Python side of the wire's ``Role``, ``NodeInfo`` and ``LoadReport``;
``pdserve_proto.convert`` is the one place that turns one into the other. This module imports
nothing (no protobuf), so the autoscaling policy can use ``NodeLoad`` and stay a cheap leaf.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # serves both Prefill and Decode

    def serves(self, wanted: Role) -> bool:
        return self is wanted or self is Role.COLOCATED


@dataclass(frozen=True)
class NodeInfo:
    """What a node serves, fixed for its lifetime: the model and its KV layout."""

    model: str
    fingerprint: str  # KV layout fingerprint (kv_store's kv_fingerprint)
    block_size: int
    max_model_len: int


@dataclass(frozen=True)
class NodeLoad:
    """A node's load: the engine's queue and KV cache, and the frontend's recent latencies and
    token rates (over the node's window, typically 30 s; 0 when it holds no sample).

    One type from the node's report to the router's balancers and autoscaler.
    """

    num_waiting: int = 0  # admitted, not yet running (including those waiting for KV)
    num_running: int = 0
    kv_usage: float = 0.0  # used / total KV blocks, in [0, 1]
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    queued_prompt_tokens: int = 0  # prompt tokens of waiting requests still to compute
    max_num_seqs: int = 0  # capacity, to normalise num_running (0: unknown)
    draining: bool = False  # accepts no new requests; finishes the running ones
    ttft_p50_ms: float = 0.0  # prefill: arrival at the node to first token
    ttft_p90_ms: float = 0.0
    itl_p50_ms: float = 0.0  # decode: gap between successive tokens of a request
    itl_p90_ms: float = 0.0
    prefill_tokens_per_s: float = 0.0  # prompt tokens computed
    decode_tokens_per_s: float = 0.0  # tokens generated
    # speculative decoding, counted over the engine's life (acceptance rate = accepted / draft
    # tokens; mean accepted length = 1 + accepted / drafts)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # liveness: turns of the engine-core loop (monotonic over the engine's life) and the
    # requests the node holds; a node holding requests whose steps stop moving is stuck
    engine_steps: int = 0
    num_requests: int = 0
    lora_adapters: tuple[str, ...] = ()  # LoRA adapters it serves now, by name
