"""OpenAI response bodies and SSE framing for completions and chat completions.

Streaming follows OpenAI: each event is ``data: <json>\\n\\n``; the stream ends with
``data: [DONE]\\n\\n``. With ``stream_options.include_usage`` every chunk carries
``"usage": null`` (with vLLM's ``continuous_usage_stats`` too, the usage so far) and one last
chunk with ``"choices": []`` carries the usage. A failure after
the stream started is sent as ``data: {"error": {...}}`` followed by ``[DONE]``.
Chat chunks open each choice with ``delta.role = "assistant"``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from common.request import TokenLogprobs
from router.flow import Usage
from router.prompts import PromptProcessor
from router.sample import SampleDelta

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


PromptLogprobs = list[TokenLogprobs | None]


@dataclass(frozen=True)
class EchoPrompt:
    """A completion prompt echoed before its choices' text (``echo``)."""

    text: str
    token_ids: list[int]


@dataclass
class ChoiceResult:
    """One choice accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason


class _Formatter:
    """Common fields of every body of one response."""

    object_name = ""
    chunk_object_name = ""

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        prompts: PromptProcessor,
        logprobs: bool,
        include_usage: bool,
        continuous_usage: bool = False,
        prompt_logprobs: bool = False,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.prompts = prompts
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage  # vLLM: needs both
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs field in the body

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, delta: SampleDelta, usage: Usage | None = None) -> dict[str, Any]:
        """One stream chunk; ``usage`` (so far) is shown with ``continuous_usage``."""
        body = self._envelope(self.chunk_object_name, [self.chunk_choice(delta)])
        if self.include_usage:
            show = self.continuous_usage and usage is not None
            body["usage"] = usage_body(usage) if show else None  # type: ignore[arg-type]
        return body

    def prompt_logprobs_body(self, items: PromptLogprobs | None) -> list[Any] | None:
        """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
        {token id: {"logprob", "rank", "decoded_token"}} for the token and its top k (rank
        known for the top k only)."""
        if items is None:
            return None
        return [None if i is None else self._vllm_logprobs(i) for i in items]

    def _vllm_logprobs(self, item: TokenLogprobs) -> dict[str, Any]:
        ranked = {t: r for r, t in enumerate(item.top_ids, start=1)}
        entries = {item.token_id: item.logprob, **dict(zip(item.top_ids, item.top_logprobs))}
        return {
            str(t): {"logprob": lp, "rank": ranked.get(t), "decoded_token": self._text(t)}
            for t, lp in entries.items()
        }

    def _text(self, token_id: int) -> str:
        return self.prompts.token_text(token_id)

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage_body(usage)}

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        bodies = [self.final_choice(i, c) for i, c in enumerate(choices)]
        return {**self._envelope(self.object_name, bodies), "usage": usage_body(usage)}

    def chunk_choice(self, delta: SampleDelta) -> dict[str, Any]:
        raise NotImplementedError

    def final_choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        raise NotImplementedError


class CompletionFormatter(_Formatter):
    """``text_completion`` bodies. Choice ``i*n + j`` is sample ``j`` of prompt ``i``; with
    ``echo`` the prompt's text is prepended to each of its choices' text (and, with logprobs,
    its tokens lead the choice's logprobs, the first with a None logprob, as in vLLM)."""

    object_name = chunk_object_name = "text_completion"

    def __init__(
        self, *args: Any, echo: list[EchoPrompt] | None = None, n: int = 1, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.echo = echo
        self.n = n
        self._offsets: dict[int, int] = {}  # per choice: text offset of the next token
        self._started: set[int] = set()

    def _echo_of(self, index: int) -> EchoPrompt | None:
        return None if self.echo is None else self.echo[index // self.n]

    def chunk_choice(self, delta: SampleDelta) -> dict[str, Any]:
        first = delta.index not in self._started
        self._started.add(delta.index)
        return self._choice(delta.index, delta, first)

    def final_choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        return self._choice(index, choice, True)

    def _choice(self, index: int, out: SampleDelta | ChoiceResult, first: bool) -> dict[str, Any]:
        echo = self._echo_of(index) if first else None
        logprobs = None
        if self.logprobs:
            logprobs = self._logprobs(index, out.logprobs, echo, out.prompt_logprobs)
        body = {
            "index": index,
            "text": (echo.text if echo else "") + out.text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        if first:  # vLLM sends null when not asked: clients read the key
            body["prompt_logprobs"] = (
                self.prompt_logprobs_body(out.prompt_logprobs) if self.prompt_logprobs else None
            )
        return body

    def _logprobs(
        self,
        index: int,
        items: list[TokenLogprobs],
        echo: EchoPrompt | None,
        prompt: PromptLogprobs | None,
    ) -> dict[str, Any]:
        """OpenAI's completion logprobs. ``top_logprobs`` always holds the chosen token, then
        the top k (vLLM's answer; ``logprobs=0`` gives the chosen one alone)."""
        rows: list[tuple[int, float | None, dict[str, float] | None]] = []
        if echo is not None:
            prompt = prompt or [None] * len(echo.token_ids)
            rows += [(t, *self._row(lp)) for t, lp in zip(echo.token_ids, prompt)]
        rows += [(i.token_id, *self._row(i)) for i in items]
        tokens = [self._text(t) for t, _, _ in rows]
        offset = self._offsets.get(index, 0)  # echoed prompt tokens come first
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": offsets,
        }

    def _row(self, item: TokenLogprobs | None) -> tuple[float | None, dict[str, float] | None]:
        if item is None:
            return None, None
        top = {self._text(item.token_id): item.logprob}
        top.update({self._text(t): lp for t, lp in zip(item.top_ids, item.top_logprobs)})
        return item.logprob, top


class ChatFormatter(_Formatter):
    """``chat.completion`` / ``chat.completion.chunk`` bodies."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened: set[int] = set()
        self.echo: str | None = None  # vLLM's chat echo: the last (assistant) message

    def chunk_choice(self, delta: SampleDelta) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text}
        if delta.index not in self._opened:
            self._opened.add(delta.index)
            message = {"role": "assistant", "content": (self.echo or "") + delta.text}
        return {
            "index": delta.index,
            "delta": message,
            "logprobs": self._logprobs(delta.logprobs) if self.logprobs else None,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict[str, Any]:
        body = super().response(choices, usage)
        # vLLM puts the chat's at the top level, null when not asked
        body["prompt_logprobs"] = (
            self.prompt_logprobs_body(choices[0].prompt_logprobs) if self.prompt_logprobs else None
        )
        return body

    def final_choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": (self.echo or "") + choice.text},
            "logprobs": self._logprobs(choice.logprobs) if self.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.prompts.token_text(token_id)
        return {
            "token": token,
            "logprob": logprob,
            "bytes": list(self.prompts.token_bytes(token_id)),
        }

    def _logprobs(self, items: list[TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._entry(i.token_id, i.logprob),
                    "top_logprobs": [
                        self._entry(t, lp) for t, lp in zip(i.top_ids, i.top_logprobs)
                    ],
                }
                for i in items
            ]
        }
