"""``SpeculativeConfig``: vLLM's ``speculative_config`` dict, validated (no torch here)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` (prompt lookup) or ``draft_model`` (``model`` names the draft).

    ``num_speculative_tokens``: drafts per step (k). ``prompt_lookup_max``/``min``: the longest
    and shortest suffix n-gram looked up (ngram only).
    """

    method: Literal["ngram", "draft_model"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model' (the draft)")

    @staticmethod
    def from_dict(values: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's dict; an unknown key is refused. Only one lookup bound given: both."""
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}")
        values = dict(values)
        lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
        if lo is not None and hi is None:
            values["prompt_lookup_max"] = max(lo, SpeculativeConfig.prompt_lookup_max)
        if hi is not None and lo is None:
            values["prompt_lookup_min"] = min(hi, SpeculativeConfig.prompt_lookup_min)
        return SpeculativeConfig(**values)
