"""Typed messages between a node's frontend and its engine-core process (msgpack, never pickle).

One ``msgspec.Struct`` per event, every field declared once, here or on the payload it carries
(``EngineCoreOutput``, ``TokenLogprobs``, ``KVHandle``, ``EngineStats`` are Structs themselves;
``SamplingParams``, a dataclass, is encoded by msgspec as it is). :func:`decode` reads bytes into
exactly one of the messages of :data:`CoreMessage` — a tagged union on the ``kind`` field — and
nothing else: an unknown ``kind``, a missing, extra or mistyped field, or sampling params that fail
their validation (``SamplingParams.__post_init__`` runs again on this side) is a ``ValueError``.
Nothing from the wire is ever executed or unpickled.

```
 frontend ──PUSH──▶ core (PULL)     AddRequest, AbortRequests, GetLoad, Shutdown
 frontend ◀──PULL── core (PUSH)     Ready, Outputs, RequestError, LoadStats, Fatal
```
"""

from __future__ import annotations

from typing import Any

import msgspec

from common.config import EngineConfig
from common.kv_interface import KVHandle
from common.lora.adapter import LoraRef
from common.sampling_params import SamplingParams
from common.step_outputs import EngineCoreOutput, EngineStats


class Message(msgspec.Struct, tag_field="kind", forbid_unknown_fields=True):
    """Base of every message; on the wire, ``kind`` names its class (the ``tag=`` below)."""


# frontend → core


class AddRequest(Message, tag="add"):
    """Queue a request. ``output_token_ids`` resumes one (they count as already generated)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    output_token_ids: list[int] = []
    kv_handle: KVHandle | None = None  # where the prompt's KV is (a decode node's request)
    lora: LoraRef | None = None  # the LoRA adapter it runs under (resolved by the frontend)


class AbortRequests(Message, tag="abort"):
    """Abort requests in any state; the core answers with an ``abort`` output for each it held."""

    request_ids: list[str]


class GetLoad(Message, tag="get_load"):
    """Ask for a :class:`LoadStats`; ``query_id`` pairs the reply with the question."""

    query_id: int


class Shutdown(Message, tag="shutdown"):
    """Abort everything, release the engine and exit."""


# core → frontend


class Ready(Message, tag="ready"):
    """Sent once, when the engine is built: what the frontend needs to know about it."""

    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_total_blocks: int
    max_num_seqs: int
    kv_fingerprint: str | None  # layout fingerprint of the KV store connector, if any
    pid: int


class RequestTiming(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """Where a request's time went inside the core until its first output (milliseconds).

    ``queue_ms``: arrival → first scheduled (or parked for a KV load); ``load_ms``: time spent
    waiting for KV from the store; ``compute_ms``: the rest, up to the first output (for a
    producer this includes ``wait_for_save``: a step's tokens come back only once its blocks
    are durable).
    """

    queue_ms: float
    load_ms: float
    compute_ms: float


class Outputs(Message, tag="outputs"):
    """One step's outputs. ``timings[i]`` is set on the first output of a request only."""

    outputs: list[EngineCoreOutput]
    timings: list[RequestTiming | None]


class RequestError(Message, tag="request_error"):
    """An ``AddRequest`` the engine refused. ``code``: one of :data:`ERROR_CODES`."""

    request_id: str
    code: str
    message: str


# request_failed: a step failed because of the request (it ended; the engine goes on)
ERROR_CODES = ("invalid_argument", "resource_exhausted", "request_failed")


class LoadStats(EngineStats, Message, tag="load", kw_only=True):
    """The engine's load between two steps (the fields of ``EngineStats``), answering the
    :class:`GetLoad` with the same ``query_id``. ``engine_steps``: turns of the core's loop so far
    (monotonic; a core holding requests whose count stops moving is stuck)."""

    query_id: int
    engine_steps: int = 0


class Fatal(Message, tag="fatal"):
    """The core failed (start-up or step); it exits right after sending this."""

    message: str


CoreMessage = (
    AddRequest
    | AbortRequests
    | GetLoad
    | Shutdown
    | Ready
    | Outputs
    | RequestError
    | LoadStats
    | Fatal
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CoreMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    """Bytes → message. Raises ValueError on anything malformed."""
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ValueError(f"malformed core message: {e}") from e


class _AddRequestId(msgspec.Struct, tag_field="kind", tag="add"):
    request_id: str


_request_id_decoder = msgspec.msgpack.Decoder(_AddRequestId)


def malformed_request_id(data: bytes) -> str | None:
    """The request id of an ``AddRequest`` that :func:`decode` refused, when it can be read (so
    its sender can be told why, instead of waiting for ever)."""
    try:
        return _request_id_decoder.decode(data).request_id
    except msgspec.DecodeError:
        return None


# -- the engine's configuration, handed to the engine-core process as plain values -----------


def engine_config_to_dict(config: EngineConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)


def engine_config_from_dict(data: dict[str, Any]) -> EngineConfig:
    """Rebuilds (and so re-validates) the config. Raises ValueError on anything malformed."""
    return msgspec.convert(data, EngineConfig)
