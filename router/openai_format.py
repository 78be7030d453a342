"""OpenAI response bodies and SSE framing for completions and chat completions.

Streaming follows OpenAI: each event is ``data: <json>\\n\\n``; the stream ends with
``data: [DONE]\\n\\n``. With ``stream_options.include_usage`` every chunk carries
``"usage": null`` and one last chunk with ``"choices": []`` carries the usage. A failure after
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


@dataclass
class ChoiceResult:
    """One choice accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, delta: SampleDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
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
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.prompts = prompts
        self.logprobs = logprobs
        self.include_usage = include_usage

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, delta: SampleDelta) -> dict[str, Any]:
        body = self._envelope(self.chunk_object_name, [self.chunk_choice(delta)])
        if self.include_usage:
            body["usage"] = None
        return body

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
    """``text_completion`` bodies. ``echo_text`` is prepended to each choice's text."""

    object_name = chunk_object_name = "text_completion"

    def __init__(self, *args: Any, echo_text: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.echo_text = echo_text
        self._offsets: dict[int, int] = {}  # per choice: text offset of the next token
        self._echoed: set[int] = set()

    def chunk_choice(self, delta: SampleDelta) -> dict[str, Any]:
        text = delta.text
        if self.echo_text is not None and delta.index not in self._echoed:
            self._echoed.add(delta.index)
            text = self.echo_text + text
        return {
            "index": delta.index,
            "text": text,
            "logprobs": self._logprobs(delta.index, delta.logprobs) if self.logprobs else None,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def final_choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        prefix = self.echo_text or ""
        return {
            "index": index,
            "text": prefix + choice.text,
            "logprobs": self._logprobs(index, choice.logprobs) if self.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def _logprobs(self, index: int, items: list[TokenLogprobs]) -> dict[str, Any]:
        tokens = [self.prompts.token_text(i.token_id) for i in items]
        offset = self._offsets.get(index, len(self.echo_text or ""))
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [
                {self.prompts.token_text(t): lp for t, lp in zip(i.top_ids, i.top_logprobs)}
                for i in items
            ],
            "text_offset": offsets,
        }


class ChatFormatter(_Formatter):
    """``chat.completion`` / ``chat.completion.chunk`` bodies."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._opened: set[int] = set()

    def chunk_choice(self, delta: SampleDelta) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text}
        if delta.index not in self._opened:
            self._opened.add(delta.index)
            message = {"role": "assistant", **message}
        return {
            "index": delta.index,
            "delta": message,
            "logprobs": self._logprobs(delta.logprobs) if self.logprobs else None,
            "finish_reason": delta.finish_reason,
            "stop_reason": delta.stop_reason,
        }

    def final_choice(self, index: int, choice: ChoiceResult) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._logprobs(choice.logprobs) if self.logprobs else None,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.prompts.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

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
