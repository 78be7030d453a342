"""Wire messages ↔ ``common`` dataclasses: the one place a node touches generated proto types.

Every ``*_from_proto`` raises ``ValueError`` with a message fit for the client on bad input.
"""

from __future__ import annotations

import numpy as np
from pdserve_proto import pdserve_pb2 as pb

from common.core_messages import LoadStats
from common.kv_connector import KVHandle
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams

HASH_BYTES = 32  # chained SHA-256 (common/block_hash.py)

_FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def _f32(value: float) -> float:
    """The shortest decimal that round-trips a float32 (0.7f → 0.7, not 0.699999988…), so a
    request sampled on a node uses the same parameters as the same request in-process."""
    return float(str(np.float32(value)))


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto → validated ``SamplingParams`` (n = 1: nodes see one sequence per request)."""
    return SamplingParams(
        temperature=_f32(msg.temperature) if msg.HasField("temperature") else 1.0,
        top_p=_f32(msg.top_p) if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.top_k > 0 else -1,
        min_p=_f32(msg.min_p),
        repetition_penalty=(
            _f32(msg.repetition_penalty) if msg.HasField("repetition_penalty") else 1.0
        ),
        presence_penalty=_f32(msg.presence_penalty),
        frequency_penalty=_f32(msg.frequency_penalty),
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """``SamplingParams`` → proto (for clients: router, tests, benchmarks). Ignores ``n`` and
    the text-level fields (stop strings, detokenisation), which nodes never see."""
    msg = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=max(params.top_k, 0),
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.max_tokens is not None:
        msg.max_tokens = params.max_tokens
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def kv_handle_from_proto(msg: pb.KVHandle) -> KVHandle:
    """Proto → ``KVHandle``, checking only its own consistency (not which model it is for)."""
    if not msg.fingerprint or msg.block_size < 1 or msg.num_tokens < 1:
        raise ValueError("malformed KV handle: fingerprint, block_size and num_tokens are required")
    expected = -(-msg.num_tokens // msg.block_size)
    if len(msg.block_hashes) != expected:
        raise ValueError(
            f"malformed KV handle: {len(msg.block_hashes)} block hashes for {msg.num_tokens}"
            f" tokens of block size {msg.block_size} (expected {expected})"
        )
    if any(len(h) != HASH_BYTES for h in msg.block_hashes):
        raise ValueError(f"malformed KV handle: block hashes must be {HASH_BYTES} bytes")
    return KVHandle(
        fingerprint=msg.fingerprint,
        block_size=msg.block_size,
        num_tokens=msg.num_tokens,
        block_hashes=list(msg.block_hashes),
        store_url=msg.store_url if msg.HasField("store_url") else None,
    )


def kv_handle_to_proto(handle: KVHandle) -> pb.KVHandle:
    msg = pb.KVHandle(
        fingerprint=handle.fingerprint,
        block_size=handle.block_size,
        num_tokens=handle.num_tokens,
        block_hashes=handle.block_hashes,
    )
    if handle.store_url is not None:
        msg.store_url = handle.store_url
    return msg


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=lp.top_ids,
        top_logprobs=lp.top_logprobs,
    )


def finish_reason_to_proto(reason: str | None) -> pb.FinishReason.ValueType:
    return _FINISH_REASONS.get(reason, pb.FINISH_REASON_ERROR)


def load_report(
    role: pb.Role.ValueType, stats: LoadStats | None, max_num_seqs: int, draining: bool
) -> pb.LoadReport:
    """The engine part of a ``LoadReport`` (latency and rate fields are added by the caller)."""
    report = pb.LoadReport(role=role, draining=draining, max_num_seqs=max_num_seqs)
    if stats is not None:
        report.num_waiting = stats.num_waiting
        report.num_running = stats.num_running
        report.kv_usage = stats.kv_usage
        report.num_free_blocks = stats.num_free_blocks
        report.num_total_blocks = stats.num_total_blocks
        report.queued_prompt_tokens = stats.queued_prompt_tokens
    return report
