"""Text side of a request: incremental detokenization and stop strings.

Shared by the offline ``LLM`` and the router, so both stop at the same place with the same text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.detokenizer import IncrementalDetokenizer
from common.request import TokenLogprobs
from common.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    # vLLM's: per prompt token (None first) when SamplingParams.prompt_logprobs was set
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class TextStream:
    """Detokenizes one sample's tokens and finds stop strings.

    ``add(token_ids)`` returns the next text delta to show. A tail that could still grow into a
    stop string is held back until it cannot (or the request ends: ``flush``). Once a stop string
    matches, ``stopped`` names it, the text is cut there (kept when
    ``include_stop_str_in_output``) and later tokens are ignored.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.text = ""  # everything detokenized so far (cut at the stop string)
        self.stopped: str | None = None
        self._emitted = 0
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def add(self, token_ids: list[int], final: bool = False) -> str:
        if self.stopped is not None:
            return ""
        before = len(self.text)
        self.text += self.detok.add_tokens(token_ids)
        if final:
            self.text += self.detok.finish()
        if self.stop:
            self._cut_at_stop(max(0, before - self._hold))
        if final or self.stopped is not None or not self.stop:
            return self.flush()
        end = max(self._emitted, len(self.text) - self._hold)
        delta, self._emitted = self.text[self._emitted : end], end
        return delta

    def flush(self) -> str:
        """Everything not yet returned (call when the request has finished)."""
        delta, self._emitted = self.text[self._emitted :], len(self.text)
        return delta

    def _cut_at_stop(self, start: int) -> None:
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return
        index, stop = min(hits)
        self.stopped = stop
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
