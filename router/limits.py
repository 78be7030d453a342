"""Caps on what one request may ask for: one table, checked by both front doors.

``BOUNDS`` is the table. HTTP checks it while it parses a body (naming the OpenAI field, so a
chat client reads ``top_logprobs``), and ``RouterCore.prepare`` checks it again on the
``SamplingParams`` that every request becomes, HTTP and gRPC alike: no field reaches a node
unchecked (a gRPC ``prompt_logprobs`` of 1000000 once reached every prefill engine's ``topk``).
Over a cap is a 400 / INVALID_ARGUMENT, never a silent clamp. Types and signs are checked where
the values are parsed (pydantic, ``SamplingParams``); this table holds the server's own caps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from common.sampling_params import SamplingParams
from router.errors import invalid_request


@dataclass(frozen=True)
class Limits:
    """The caps (``BOUNDS`` says which field each one bounds). ``max_prompt_tokens`` None:
    only the nodes' context bounds a prompt."""

    max_n: int = 8
    max_logprobs: int = 20
    max_stop_strings: int = 16
    max_stop_token_ids: int = 64
    max_prompts: int = 64  # prompts in one batched /v1/completions request
    max_prompt_tokens: int | None = None
    # A structured-outputs spec (schema, regex, grammar or choices) as text. Compile time grows
    # faster than size (xgrammar, a JSON-schema enum: 8,000 values, 111 KB, 0.11 s; 20,000
    # values, 289 KB, 21 s on the node's one compile thread, which every such request queues on).
    max_structured_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        for name in ("max_logprobs", "max_stop_strings", "max_stop_token_ids"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        for name in ("max_n", "max_prompts", "max_prompt_tokens", "max_structured_bytes"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


class Bound(NamedTuple):
    """``field`` (a ``SamplingParams`` field) lies in ``[low, limits.<cap>]``; with ``count``
    its number of items does (a list), and ``unit`` names them in the message."""

    field: str
    low: int
    cap: str
    count: bool = False
    unit: str = ""


BOUNDS: tuple[Bound, ...] = (
    Bound("n", 1, "max_n"),
    Bound("logprobs", 0, "max_logprobs"),
    Bound("prompt_logprobs", 0, "max_logprobs"),
    Bound("stop", 0, "max_stop_strings", count=True, unit="stop strings"),
    Bound("stop_token_ids", 0, "max_stop_token_ids", count=True, unit="stop token ids"),
)


def check_bounds(
    values: Mapping[str, int | Sequence[object] | None],
    limits: Limits,
    names: Mapping[str, str] | None = None,
) -> None:
    """Raise a 400 (RouterError) naming the first value of ``values`` (field → value; None or
    absent: not asked for) outside its bound. ``names``: the client's name of a field."""
    for bound in BOUNDS:
        value = values.get(bound.field)
        if value is None:
            continue
        name = (names or {}).get(bound.field, bound.field)
        high = getattr(limits, bound.cap)
        if bound.count:
            assert isinstance(value, Sequence)
            if len(value) > high:
                raise invalid_request(f"at most {high} {bound.unit}, got {len(value)}", name)
        elif not bound.low <= value <= high:  # type: ignore[operator]
            raise invalid_request(f"{name} must be in [{bound.low}, {high}], got {value}", name)


def check_params(params: SamplingParams, limits: Limits) -> None:
    """``params`` within the table (what every request passes before it reaches a node)."""
    check_bounds({b.field: getattr(params, b.field) for b in BOUNDS}, limits)
    spec = params.structured_outputs
    if spec is not None:
        size = len(spec.key()[1].encode())
        if size > limits.max_structured_bytes:
            raise invalid_request(
                f"structured outputs spec of {size} bytes; this router takes at most"
                f" {limits.max_structured_bytes} (its compile time grows faster than its size)",
                "structured_outputs",
            )


def check_beam_width(width: int, limits: Limits) -> None:
    """A beam search's width (``best_of``) in ``[1, max_n]``: each beam is a request a round."""
    if not 1 <= width <= limits.max_n:
        raise invalid_request(f"best_of must be in [1, {limits.max_n}], got {width}", "best_of")


def check_prompt_length(num_tokens: int, limits: Limits) -> None:
    """A prompt of ``num_tokens`` within ``max_prompt_tokens``; 400 otherwise."""
    cap = limits.max_prompt_tokens
    if cap is not None and num_tokens > cap:
        raise invalid_request(
            f"prompt has {num_tokens} tokens; this router takes at most {cap}",
            param="prompt",
            code="context_length_exceeded",
        )
