"""OpenAI request bodies: schemas, strict validation, caps, and conversion to SamplingParams.

Validation is strict (no ``"5"`` → 5, no ``true`` → 1): a wrong type is a 400, never a guess.
Unknown fields are ignored, as vLLM does, except the few whose meaning we would silently drop
(``suffix``, ``logit_bias``, ``tools``, ``best_of != n``): those are rejected by name.
Besides OpenAI's fields both endpoints accept vLLM's extras: ``ignore_eos``, ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``seed``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output`` and ``priority``.

Every failure raises :class:`router.errors.RouterError` (status 400) naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from common.sampling_params import SamplingParams
from router.errors import RouterError, invalid_request


def _valid_unicode(text: str) -> str:
    """Reject lone surrogates (``"\\ud800"`` is valid JSON but not encodable UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string is not valid UTF-8 (lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


@dataclass(frozen=True)
class Limits:
    """Caps on what one request may ask for; over a cap is a 400, not a silent clamp."""

    max_n: int = 8
    max_logprobs: int = 20
    max_stop_strings: int = 16


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as one string (text parts joined with newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    ignore_eos: bool = False
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_unsupported(self) -> None:
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options needs stream: true", param="stream_options")


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt`` is one text or one list of token ids."""

    prompt: Text | list[int]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise invalid_request("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise invalid_request("best_of must equal n (no server-side ranking)", "best_of")
        if isinstance(self.prompt, list) and not self.prompt:
            raise invalid_request("prompt is empty", param="prompt")

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; the prompt is rendered with the tokenizer's template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise invalid_request("tools are not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true", param="top_logprobs")

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


RequestT = TypeVar("RequestT", bound=_SamplingRequest)


def parse_body(raw: bytes, schema: type[RequestT], limits: Limits) -> RequestT:
    """Decode, parse and validate a JSON body; raises RouterError (400) naming the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"request body is not valid UTF-8: {exc.reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"malformed JSON body: {exc.msg} at char {exc.pos}") from None
    if not isinstance(data, dict):
        raise invalid_request("the request body must be a JSON object")
    try:
        request = schema.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check_unsupported()
    check_caps(request, limits)
    return request


def _validation_error(exc: ValidationError) -> RouterError:
    # A union field fails once per member; the deepest location is the most specific one.
    first = max(exc.errors(), key=lambda e: len(e["loc"]))
    loc = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    return invalid_request(f"{param}: {message}" if param else message, param=param)


def _is_type_tag(part: str | int) -> bool:
    """Union members add their type to the location ("prompt.list[int].1"): not a field."""
    text = str(part)
    return "[" in text or text.startswith("function-") or text in _TYPE_TAGS


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def check_caps(request: _SamplingRequest, limits: Limits) -> None:
    """n, logprobs and stop strings within their caps (max_tokens is checked with the prompt)."""
    if not 1 <= request.n <= limits.max_n:
        raise invalid_request(f"n must be in [1, {limits.max_n}], got {request.n}", "n")
    k = request.num_logprobs()  # type: ignore[attr-defined]
    if k is not None and not 0 <= k <= limits.max_logprobs:
        name = "logprobs" if isinstance(request, CompletionRequest) else "top_logprobs"
        raise invalid_request(f"{name} must be in [0, {limits.max_logprobs}], got {k}", name)
    stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if len(stops) > limits.max_stop_strings:
        raise invalid_request(f"at most {limits.max_stop_strings} stop strings", param="stop")


def requested_max_tokens(request: _SamplingRequest) -> int | None:
    """The client's output cap; completions default to 16 (OpenAI), chat to the context."""
    if isinstance(request, ChatCompletionRequest):
        return request.max_completion_tokens or request.max_tokens
    return 16 if request.max_tokens is None else request.max_tokens


def to_sampling_params(request: _SamplingRequest, max_tokens: int | None) -> SamplingParams:
    """The engine's SamplingParams for ``request``; its own range checks become 400s.

    ``seed`` is left as the client gave it (the flow fills in a random one when absent).
    """
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        return SamplingParams(
            n=request.n,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k in (None, 0) else request.top_k,
            min_p=request.min_p,
            repetition_penalty=request.repetition_penalty,
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=stop,
            stop_token_ids=list(request.stop_token_ids or []),
            ignore_eos=request.ignore_eos,
            logprobs=request.num_logprobs(),  # type: ignore[attr-defined]
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )
    except ValueError as exc:
        raise invalid_request(str(exc), param=_param_of(str(exc))) from None


def _param_of(message: str) -> str | None:
    """The field a SamplingParams message is about ("top_p must be ..." → "top_p")."""
    head = message.split(" ", 1)[0]
    return head if head.isidentifier() else None
