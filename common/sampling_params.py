"""Sampling parameters of one request, validated at construction (vLLM's names and meanings)."""

from __future__ import annotations

import hashlib
import json as _json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a grammar (vLLM's ``StructuredOutputsParams``): exactly one of
    ``json`` (a JSON schema, as a dict or its text; kept as compact text), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (EBNF/GBNF) or ``json_object`` (any JSON
    object). Only the shape is checked here; the engine compiles it and refuses what does not
    compile (a ValueError for the caller: HTTP 400, gRPC INVALID_ARGUMENT)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    disable_any_whitespace: bool = False  # JSON: no optional whitespace between tokens

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # keys in the order written: a schema's property order is the output's order
            self.json = _json.dumps(self.json, separators=(",", ":"))
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(
                "structured outputs need exactly one of json, regex, choice, grammar or"
                f" json_object, got {given or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured outputs choice must be a non-empty list of non-empty strings"
            )
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"structured outputs {name} must be a non-empty string")

    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a compiled grammar is cached under (with the tokenizer)."""
        if self.json is not None:
            return ("json_nows" if self.disable_any_whitespace else "json", str(self.json))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", _json.dumps(self.choice))
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` is greedy. ``seed`` fixes the request's random stream: token ``i`` of the
    output is drawn from a stream that depends only on ``(seed, i)``, so the same request gives
    the same tokens whatever else shares its batch and wherever it runs (colocated, disaggregated,
    migrated). Without a seed the engine draws one at arrival.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per output token (0: only the chosen)
    prompt_logprobs: int | None = None  # top logprobs per prompt token (vLLM's; prefill only)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.structured_outputs, dict):  # as msgspec or a caller hands it
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._check_ranges()

    def _check_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError("seed must be in [0, 2**63)")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def child_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of an ``n > 1`` request with ``seed``: the seed itself for sample
    0 (so it samples what the same request with ``n == 1`` samples), a distinct, reproducible
    seed derived from it for the others."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"pdserve-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
