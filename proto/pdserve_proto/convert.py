"""The one conversion layer: wire messages ↔ Python types, for the router and the nodes alike.

Each value that crosses the wire is converted here and nowhere else, so both ends agree:

- float fields travel as float32 and are read back with one rule (:func:`wire_float`), which the
  router also applies to the parameters it keeps (:func:`wire_rounded`): router, node and an
  in-process engine given the same request hold bit-identical floats;
- finish reasons have one map (``"stop"``, ``"length"``, ``"abort"``, ``"error"``; None while
  running), used by the engine's side and the router's side;
- a node's load and layout have one Python type each (``pdserve_proto.nodes``), built from the
  engine's messages on the node and read from the wire on the router.

Every ``*_from_proto`` raises ``ValueError`` with a message fit for the client on bad input.
Torch-free (the router imports it); ``common`` never imports this package.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from common.kv_interface import KVHandle
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams, StructuredOutputsParams
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto.nodes import NodeInfo, NodeLoad, Role

if TYPE_CHECKING:  # the engine's messages: only their fields are read here
    from common.core_messages import LoadStats, Ready

HASH_BYTES = 32  # chained SHA-256 (common/block_hash.py)

# SamplingParams fields that are float on the wire.
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)

_FINISH_REASONS: dict[str | None, pb.FinishReason.ValueType] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
_FINISH_NAMES = {value: name for name, value in _FINISH_REASONS.items()}

_ROLES = {
    pb.ROLE_PREFILL: Role.PREFILL,
    pb.ROLE_DECODE: Role.DECODE,
    pb.ROLE_COLOCATED: Role.COLOCATED,
}

# -- sampling parameters ----------------------------------------------------------------------


def wire_float(value: float, name: str) -> float:
    """``value`` as a node reads it: rounded to float32 (the wire's type), then the shortest
    decimal that round-trips that float32 (0.7 → 0.7f → 0.7, not 0.699999988…), so a request
    sampled on a node uses the same parameters as the same request in-process.

    Raises ValueError for NaN, ±Inf and values float32 cannot hold.
    """
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    with np.errstate(over="ignore"):
        single = np.float32(value)
    if not np.isfinite(single):
        raise ValueError(f"{name}={value} is out of range")
    return float(str(single))


def wire_rounded(params: SamplingParams) -> SamplingParams:
    """``params`` with its float fields as every node will read them (:func:`wire_float`);
    re-validated. The router keeps these, so it checks and holds what the nodes run."""
    rounded = {name: wire_float(getattr(params, name), name) for name in _FLOAT_FIELDS}
    return dataclasses.replace(params, **rounded)


def _float_or(msg: pb.SamplingParams, name: str, default: float) -> float:
    return wire_float(getattr(msg, name), name) if msg.HasField(name) else default


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Proto → validated ``SamplingParams`` (n = 1 and no stop strings: the node level)."""
    return SamplingParams(
        temperature=_float_or(msg, "temperature", 1.0),
        top_p=_float_or(msg, "top_p", 1.0),
        top_k=msg.top_k if msg.top_k > 0 else -1,
        min_p=wire_float(msg.min_p, "min_p"),
        repetition_penalty=_float_or(msg, "repetition_penalty", 1.0),
        presence_penalty=wire_float(msg.presence_penalty, "presence_penalty"),
        frequency_penalty=wire_float(msg.frequency_penalty, "frequency_penalty"),
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        min_tokens=msg.min_tokens,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured_outputs=structured_outputs_from_proto(msg.structured_outputs)
        if msg.HasField("structured_outputs")
        else None,
    )


def structured_outputs_from_proto(msg: pb.StructuredOutputs) -> StructuredOutputsParams:
    """Proto → ``StructuredOutputsParams`` (ValueError unless exactly one spec is set)."""
    kind = msg.WhichOneof("spec")
    if kind is None:
        raise ValueError(
            "structured_outputs needs one of json, regex, choice, grammar, json_object"
        )
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutputsParams(
        **{kind: value}, disable_any_whitespace=msg.disable_any_whitespace
    )


def structured_outputs_to_proto(spec: StructuredOutputsParams) -> pb.StructuredOutputs:
    msg = pb.StructuredOutputs(disable_any_whitespace=spec.disable_any_whitespace)
    if spec.json is not None:
        msg.json = str(spec.json)
    elif spec.regex is not None:
        msg.regex = spec.regex
    elif spec.choice is not None:
        msg.choice.choices.extend(spec.choice)
    elif spec.grammar is not None:
        msg.grammar = spec.grammar
    else:
        msg.json_object = True
    return msg


def generate_params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    """A client's ``GenerateRequest`` → ``SamplingParams``: the node-level fields as a node
    reads them, plus the text-level ones only the router uses (stop strings, detokenization)."""
    params = sampling_params_from_proto(request.sampling_params)
    return dataclasses.replace(
        params,
        stop=list(request.stop),
        skip_special_tokens=(
            request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        ),
        include_stop_str_in_output=request.include_stop_str_in_output,
    )


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    """``SamplingParams`` → proto. Leaves out ``n`` and the text-level fields (stop strings,
    detokenization), which nodes never see."""
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
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    if params.structured_outputs is not None:
        msg.structured_outputs.CopyFrom(structured_outputs_to_proto(params.structured_outputs))
    return msg


# -- finish reasons ---------------------------------------------------------------------------


def finish_reason_to_proto(reason: str | None) -> pb.FinishReason.ValueType:
    """``"stop"`` | ``"length"`` | ``"abort"`` | ``"error"`` | None (running) → proto."""
    try:
        return _FINISH_REASONS[reason]
    except KeyError:
        raise ValueError(f"unknown finish reason {reason!r}") from None


def finish_reason_from_proto(value: pb.FinishReason.ValueType) -> str | None:
    """Proto → the same names. None: not finished (UNSPECIFIED, and HANDED_OFF: a prefill's
    part ended, the request goes on). A value this build does not know reads as ``"error"``."""
    if value == pb.FINISH_REASON_HANDED_OFF:
        return None
    return _FINISH_NAMES.get(value, "error")


# -- tokens and KV handles --------------------------------------------------------------------


def logprob_to_proto(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_token_ids=lp.top_ids,
        top_logprobs=lp.top_logprobs,
    )


def logprobs_from_proto(items: Sequence[pb.TokenLogprob]) -> list[TokenLogprobs]:
    return [
        TokenLogprobs(
            token_id=i.token_id,
            logprob=i.logprob,
            top_ids=list(i.top_token_ids),
            top_logprobs=list(i.top_logprobs),
        )
        for i in items
    ]


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


# -- nodes: role, layout, load ----------------------------------------------------------------


def role_from_proto(value: pb.Role.ValueType) -> Role:
    try:
        return _ROLES[value]
    except KeyError:
        raise ValueError(f"unknown role {value}") from None


def node_info_from_engine(ready: Ready) -> NodeInfo:
    """A node's ``NodeInfo`` from its engine's ``Ready`` (the engine computes the fingerprint,
    so the frontend needs no torch)."""
    return NodeInfo(ready.model, ready.kv_fingerprint or "", ready.block_size, ready.max_model_len)


def node_info_to_proto(info: NodeInfo) -> pb.NodeInfo:
    return pb.NodeInfo(**dataclasses.asdict(info))


def node_info_from_proto(msg: pb.NodeInfo) -> NodeInfo:
    """Proto → ``NodeInfo``; every field is required."""
    if not msg.fingerprint or msg.block_size < 1 or msg.max_model_len < 1:
        raise ValueError(
            "node info must give the KV fingerprint, block_size >= 1 and max_model_len >= 1"
        )
    return NodeInfo(msg.model, msg.fingerprint, msg.block_size, msg.max_model_len)


def node_load_from_engine(
    stats: LoadStats | None, max_num_seqs: int, draining: bool, num_requests: int = 0
) -> NodeLoad:
    """The engine's part of a node's load (``stats`` None: the engine never answered, zeros),
    with the ``num_requests`` the frontend holds; the frontend adds its latencies and rates
    (``node_frontend.stats``)."""
    if stats is None:
        return NodeLoad(max_num_seqs=max_num_seqs, draining=draining, num_requests=num_requests)
    return NodeLoad(
        num_waiting=stats.num_waiting,
        num_running=stats.num_running,
        kv_usage=stats.kv_usage,
        num_free_blocks=stats.num_free_blocks,
        num_total_blocks=stats.num_total_blocks,
        queued_prompt_tokens=stats.queued_prompt_tokens,
        max_num_seqs=max_num_seqs,
        spec_num_drafts=stats.spec_num_drafts,
        spec_num_draft_tokens=stats.spec_num_draft_tokens,
        spec_num_accepted_tokens=stats.spec_num_accepted_tokens,
        draining=draining,
        engine_steps=stats.engine_steps,
        num_requests=num_requests,
    )


def load_to_proto(role: pb.Role.ValueType, load: NodeLoad) -> pb.LoadReport:
    return pb.LoadReport(role=role, **dataclasses.asdict(load))


def load_from_proto(report: pb.LoadReport) -> NodeLoad:
    """Proto → ``NodeLoad``, with ``kv_usage`` clamped into [0, 1] (balancers add it up)."""
    values = {f.name: getattr(report, f.name) for f in dataclasses.fields(NodeLoad)}
    usage = report.kv_usage
    values["kv_usage"] = min(max(usage, 0.0), 1.0) if math.isfinite(usage) else 0.0
    values["lora_adapters"] = tuple(report.lora_adapters)
    return NodeLoad(**values)


def prompt_logprobs_to_proto(items: Sequence[TokenLogprobs | None]) -> pb.PromptLogprobs:
    """A request's prompt logprobs (None first, as the engine gives them) → proto."""
    if items and items[0] is not None:
        raise ValueError("the first prompt token has no logprob")
    return pb.PromptLogprobs(tokens=[logprob_to_proto(i) for i in items[1:] if i is not None])


def prompt_logprobs_from_proto(response: pb.PrefillResponse) -> list[TokenLogprobs | None] | None:
    """A prefill reply's prompt logprobs: one entry per prompt token, None first; None when
    the request asked for none."""
    if not response.HasField("prompt_logprobs"):
        return None
    return [None, *logprobs_from_proto(response.prompt_logprobs.tokens)]
