"""Typed messages between a node's frontend and its engine-core process (msgpack, never pickle).

One class per event. Each knows how to turn itself into a dict of plain values
(``to_dict``) and back (``from_dict``); :func:`encode` / :func:`decode` add a ``kind`` tag and
run msgpack. Nothing here executes code from the wire: an unknown ``kind`` or a missing field is
a ``ValueError``.

```
 frontend ──PUSH──▶ core (PULL)     AddRequest, AbortRequests, GetLoad, Shutdown
 frontend ◀──PULL── core (PUSH)     Ready, Outputs, RequestError, LoadStats, Fatal
```
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

import msgpack  # type: ignore[import-untyped]

from common.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from common.kv_connector import KVHandle
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams
from common.scheduler import EngineCoreOutput

# -- value conversions ------------------------------------------------------------------------


def sampling_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in fields(SamplingParams)}


def sampling_params_from_dict(data: dict[str, Any]) -> SamplingParams:
    """Rebuilds (and so re-validates) the params; unknown keys are a ValueError."""
    names = {f.name for f in fields(SamplingParams)}
    unknown = set(data) - names
    if unknown:
        raise ValueError(f"unknown sampling params {sorted(unknown)}")
    return SamplingParams(**data)


def engine_config_to_dict(config: EngineConfig) -> dict[str, Any]:
    return asdict(config)


def engine_config_from_dict(data: dict[str, Any]) -> EngineConfig:
    parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
    top = {k: v for k, v in data.items() if k not in parts}
    return EngineConfig(**{k: cls(**data[k]) for k, cls in parts.items()}, **top)


def kv_handle_to_dict(handle: KVHandle | None) -> dict[str, Any] | None:
    return None if handle is None else asdict(handle)


def kv_handle_from_dict(data: dict[str, Any] | None) -> KVHandle | None:
    if data is None:
        return None
    return KVHandle(
        fingerprint=str(data["fingerprint"]),
        block_size=int(data["block_size"]),
        num_tokens=int(data["num_tokens"]),
        block_hashes=[bytes(h) for h in data["block_hashes"]],
        store_url=data.get("store_url"),
    )


def _logprobs_to_list(lp: TokenLogprobs) -> list[Any]:
    return [lp.token_id, lp.logprob, list(lp.top_ids), list(lp.top_logprobs)]


def _logprobs_from_list(data: list[Any]) -> TokenLogprobs:
    token_id, logprob, top_ids, top_logprobs = data
    return TokenLogprobs(int(token_id), float(logprob), list(top_ids), list(top_logprobs))


def output_to_dict(out: EngineCoreOutput) -> dict[str, Any]:
    return {
        "request_id": out.request_id,
        "new_token_ids": list(out.new_token_ids),
        "new_logprobs": [_logprobs_to_list(lp) for lp in out.new_logprobs],
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "parent_id": out.parent_id,
        "num_cached_tokens": out.num_cached_tokens,
        "kv_handle": kv_handle_to_dict(out.kv_handle),
        "num_external_tokens": out.num_external_tokens,
    }


def output_from_dict(data: dict[str, Any]) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=data["request_id"],
        new_token_ids=[int(t) for t in data["new_token_ids"]],
        new_logprobs=[_logprobs_from_list(lp) for lp in data["new_logprobs"]],
        finish_reason=data["finish_reason"],
        stop_reason=data["stop_reason"],
        parent_id=data["parent_id"],
        num_cached_tokens=int(data["num_cached_tokens"]),
        kv_handle=kv_handle_from_dict(data["kv_handle"]),
        num_external_tokens=int(data["num_external_tokens"]),
    )


# -- messages ---------------------------------------------------------------------------------


class Message:
    """Base of every message: plain dataclass fields ↔ a dict of msgpack-able values."""

    KIND: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Message:
        return cls(**data)


# frontend → core


@dataclass
class AddRequest(Message):
    """Queue a request. ``output_token_ids`` resumes one (they count as already generated)."""

    KIND: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    output_token_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["sampling_params"] = sampling_params_to_dict(self.sampling_params)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AddRequest:
        return cls(
            request_id=str(data["request_id"]),
            prompt_token_ids=list(data["prompt_token_ids"]),
            sampling_params=sampling_params_from_dict(data["sampling_params"]),
            priority=int(data["priority"]),
            output_token_ids=list(data["output_token_ids"]),
        )


@dataclass
class AbortRequests(Message):
    """Abort requests in any state; the core answers with an ``abort`` output for each it held."""

    KIND: ClassVar[str] = "abort"
    request_ids: list[str]


@dataclass
class GetLoad(Message):
    """Ask for a :class:`LoadStats`; ``query_id`` pairs the reply with the question."""

    KIND: ClassVar[str] = "get_load"
    query_id: int


@dataclass
class Shutdown(Message):
    """Abort everything, release the engine and exit."""

    KIND: ClassVar[str] = "shutdown"


# core → frontend


@dataclass
class Ready(Message):
    """Sent once, when the engine is built: what the frontend needs to know about it."""

    KIND: ClassVar[str] = "ready"
    model: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_total_blocks: int
    max_num_seqs: int
    kv_fingerprint: str | None  # layout fingerprint of the KV store connector, if any
    pid: int


@dataclass
class RequestTiming(Message):
    """Where a request's time went inside the core until its first output (milliseconds).

    ``queue_ms``: arrival → first scheduled (or parked for a KV load); ``load_ms``: time spent
    waiting for KV from the store; ``compute_ms``: the rest, up to the first output (for a
    producer this includes ``wait_for_save``: the engine samples only once blocks are durable).
    """

    KIND: ClassVar[str] = "timing"
    queue_ms: float
    load_ms: float
    compute_ms: float


@dataclass
class Outputs(Message):
    """One step's outputs. ``timings[i]`` is set on the first output of a request only."""

    KIND: ClassVar[str] = "outputs"
    outputs: list[EngineCoreOutput]
    timings: list[RequestTiming | None]

    def to_dict(self) -> dict[str, Any]:
        return {
            "outputs": [output_to_dict(o) for o in self.outputs],
            "timings": [None if t is None else t.to_dict() for t in self.timings],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Outputs:
        return cls(
            outputs=[output_from_dict(o) for o in data["outputs"]],
            timings=[None if t is None else RequestTiming(**t) for t in data["timings"]],
        )


@dataclass
class RequestError(Message):
    """An ``AddRequest`` the engine refused. ``code``: one of :data:`ERROR_CODES`."""

    KIND: ClassVar[str] = "request_error"
    request_id: str
    code: str
    message: str


ERROR_CODES = ("invalid_argument", "resource_exhausted")


@dataclass
class LoadStats(Message):
    """The engine's load between two steps."""

    KIND: ClassVar[str] = "load"
    query_id: int
    num_waiting: int  # waiting or preempted, plus those waiting for a KV load
    num_running: int
    kv_usage: float  # used / total blocks, in [0, 1]
    num_free_blocks: int
    num_total_blocks: int
    queued_prompt_tokens: int  # prompt tokens of waiting requests still to compute


@dataclass
class Fatal(Message):
    """The core failed (start-up or step); it exits right after sending this."""

    KIND: ClassVar[str] = "fatal"
    message: str


_MESSAGES: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        AddRequest,
        AbortRequests,
        GetLoad,
        Shutdown,
        Ready,
        Outputs,
        RequestError,
        LoadStats,
        Fatal,
    )
}


def encode(message: Message) -> bytes:
    return msgpack.packb({"kind": message.KIND, "body": message.to_dict()}, use_bin_type=True)


def decode(data: bytes) -> Message:
    """Bytes → message. Raises ValueError on anything malformed."""
    try:
        raw = msgpack.unpackb(data, raw=False)
        cls = _MESSAGES[raw["kind"]]
        return cls.from_dict(raw["body"])
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"malformed core message: {e!r}") from e
