"""OpenAI request bodies: schemas, strict validation, caps, and conversion to SamplingParams.

Validation is strict (no ``"5"`` → 5, no ``true`` → 1): a wrong type is a 400, never a guess.
Every OpenAI or vLLM parameter pdserve does not implement is refused by name when set to
anything but its default (``UNSUPPORTED``; docs/API.md has the whole table): nothing a client
asks for is silently dropped. Fields neither API defines are ignored, as vLLM does.
Besides OpenAI's fields both endpoints accept vLLM's extras: ``ignore_eos``, ``top_k``,
``min_p``, ``repetition_penalty``, ``min_tokens``, ``seed``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``priority``, ``prompt_logprobs``
and (chat) ``chat_template_kwargs``.

Every failure raises :class:`router.errors.RouterError` (status 400) naming the field.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from common.sampling_params import SamplingParams, StructuredOutputsParams
from router.errors import RouterError, invalid_request
from router.limits import Limits, check_beam_width, check_bounds


def _valid_unicode(text: str) -> str:
    """Reject lone surrogates (``"\\ud800"`` is valid JSON but not encodable UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("string is not valid UTF-8 (lone surrogate)") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
# Numbers are bounded where they are parsed: NaN and ±Infinity (which Python's json accepts)
# are refused naming the field, and integers fit the wire's int32 (top_k, priority).
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
Priority = Annotated[int, Field(ge=INT32_MIN, le=INT32_MAX)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Request(BaseModel):
    """A request body: unknown fields are kept (``model_extra``) so that the OpenAI / vLLM
    parameters pdserve does not implement can be refused by name (``refuse_unsupported``)."""

    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk too


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


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: the schema sits under ``schema``."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` request field (one spec)."""

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    json_: dict[str, Any] | Text | None = Field(default=None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: FiniteFloat | None = None
    top_p: FiniteFloat | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: FiniteFloat = 0.0
    frequency_penalty: FiniteFloat = 0.0
    seed: int | None = None
    user: str | None = None
    logit_bias: dict[str, FiniteFloat] | None = None
    # vLLM extras
    ignore_eos: bool = False
    top_k: TopK | None = None
    min_p: FiniteFloat = 0.0
    repetition_penalty: FiniteFloat = 1.0
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: Priority = 0
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older
    # guided_* names (structured_outputs_of below checks them and builds the one spec)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None

    prompt_logprobs: int | None = None  # vLLM: top-k logprobs of every prompt token

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_unsupported(self) -> None:
        refuse_unsupported(self)
        if self.logit_bias:
            raise invalid_request("logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise invalid_request("stream_options needs stream: true", param="stream_options")


Prompt = Text | list[int]


def _is_ids(value: list[Any]) -> bool:
    return all(isinstance(v, int) for v in value)


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt`` is one text, one list of token ids, or a batch
    (a list of texts or a list of token-id lists); :meth:`prompts` gives the batch."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None
    # vLLM's beam search: ``best_of`` beams (``n`` when unset), the ``n`` best returned
    use_beam_search: bool = False
    length_penalty: FiniteFloat = 1.0

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.suffix:
            raise invalid_request("suffix is not supported", param="suffix")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of is not None and self.best_of != self.n:
            raise invalid_request(
                "best_of must equal n (no server-side ranking without use_beam_search)", "best_of"
            )
        elif self.length_penalty != 1.0:
            raise invalid_request("length_penalty needs use_beam_search: true", "length_penalty")
        for i, prompt in enumerate(self.prompts()):
            if not prompt:
                where = "prompt" if not self.batched else f"prompt.{i}"
                raise invalid_request(f"{where} is empty", param="prompt")
        if self.max_tokens == 0 and not self.echo:
            raise invalid_request("max_tokens=0 needs echo: true (prompt scoring)", "max_tokens")

    def _check_beam_search(self) -> None:
        """What a beam search refuses: the width below ``n``, and every field that would change
        which tokens it ranks or how they come back (the sampling knobs temperature, top_p,
        top_k, min_p and seed do not apply: beams rank by log-probability)."""
        if self.beam_width < self.n:
            raise invalid_request(f"best_of ({self.beam_width}) must be >= n ({self.n})", "best_of")
        refused = {
            "stream": self.stream,
            "echo": self.echo,
            "logprobs": self.logprobs is not None,
            "prompt_logprobs": self.prompt_logprobs is not None,
            "stop": bool(self.stop),
            "stop_token_ids": bool(self.stop_token_ids),
            "min_tokens": self.min_tokens > 0,
            "presence_penalty": self.presence_penalty != 0.0,
            "frequency_penalty": self.frequency_penalty != 0.0,
            "repetition_penalty": self.repetition_penalty != 1.0,
            "structured_outputs": bool(_structured_specs(self)),
        }
        for name, asked in refused.items():
            if asked:
                raise invalid_request(f"{name} is not supported with use_beam_search", name)
        if self.max_tokens == 0:
            raise invalid_request("use_beam_search needs max_tokens >= 1", "max_tokens")

    @property
    def beam_width(self) -> int:
        return self.n if self.best_of is None else self.best_of

    @property
    def batched(self) -> bool:
        """A list of prompts (not one text, not one list of token ids)."""
        return isinstance(self.prompt, list) and bool(self.prompt) and not _is_ids(self.prompt)

    def prompts(self) -> list[Prompt]:
        """The batch: one entry per prompt (a single prompt is a batch of one)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if self.batched:
            return list(self.prompt)  # type: ignore[arg-type]
        return [self.prompt]  # type: ignore[list-item]

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """Prompt logprobs to compute: vLLM's ``prompt_logprobs``, or ``echo`` with logprobs
        (the echoed prompt carries its logprobs, as in vLLM)."""
        if self.echo and self.logprobs is not None:
            return max(self.logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``; the prompt is rendered with the tokenizer's template."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message is left open and the reply continues it (no new turn)
    continue_final_message: bool = False
    # vLLM's: the reply is prefixed with the last message when that one is the assistant's
    echo: bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.tools:
            raise invalid_request("tools are not supported", param="tools")
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid_request(
                "continue_final_message continues the last message: it needs"
                " add_generation_prompt: false",
                param="continue_final_message",
            )

    def echo_text(self) -> str | None:
        """What ``echo`` prefixes the reply with: the last message, if the assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs


# OpenAI / vLLM request parameters pdserve does not implement, with the value that means
# "not asked for" (none: any value but null is refused); anything else is refused naming the
# parameter (docs/API.md lists them all).
# logit_bias, suffix, tools and best_of != n have their own messages above.
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    # OpenAI
    "logprobs_mode": (),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": (),
    "function_call": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "reasoning_effort": (),
    "web_search_options": (),
    "store": (False,),
    "metadata": (),
    "service_tier": ("auto", "default"),
    # vLLM extras
    "use_beam_search": (False,),  # chat (completions: router/beams.py)
    "length_penalty": (1.0,),  # chat
    "best_of": (1,),  # chat (completions: best_of == n, or the beam width)
    "allowed_token_ids": (),
    "bad_words": ([],),
    "truncate_prompt_tokens": (),
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "return_token_ids": (False,),
    "prompt_embeds": (),
    "add_special_tokens": (),  # completions: True, chat: False (see _ADD_SPECIAL)
    "documents": (),
    "chat_template": (),
    "mm_processor_kwargs": (),
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "guided_json_object": (False,),
    "structural_tag": (),
    "request_id": (),
    "cache_salt": (),
    "kv_transfer_params": (),
    "vllm_xargs": (),
    "logits_processors": (),
    "thinking_token_budget": (),
}
_ADD_SPECIAL = {"CompletionRequest": True, "ChatCompletionRequest": False}


def refuse_unsupported(request: BaseModel) -> None:
    """400 naming the first parameter in ``UNSUPPORTED`` that is set to a non-default value
    (``None`` always counts as not set, as in vLLM's schemas)."""
    extra = request.model_extra or {}
    for name, value in extra.items():
        if name not in UNSUPPORTED or value is None:
            continue
        allowed = UNSUPPORTED[name]
        if name == "add_special_tokens":
            allowed = (_ADD_SPECIAL.get(type(request).__name__),)
        if value not in allowed:
            raise invalid_request(f"{name} is not supported by pdserve", param=name)


class TokenizeRequest(_Strict):
    """vLLM's ``POST /tokenize``: a ``prompt``, or chat ``messages`` rendered first."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise invalid_request("give either prompt or messages", param="prompt")


class DetokenizeRequest(_Strict):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[int]


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``POST /v1/load_lora_adapter``: serve the PEFT directory ``lora_path`` (on the
    nodes' file system) as model ``lora_name``."""

    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``POST /v1/unload_lora_adapter``."""

    lora_name: str


RequestT = TypeVar("RequestT", bound=_SamplingRequest)
ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_model(raw: bytes, schema: type[ModelT]) -> ModelT:
    """Decode, parse and validate a JSON body into ``schema``; RouterError (400) naming the
    problem. Runs the schema's own ``check()`` if it has one."""
    try:
        request = schema.model_validate(_json_object(raw))
    except ValidationError as exc:
        raise _validation_error(exc) from None
    check = getattr(request, "check", None)
    if check is not None:
        check()
    return request


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise invalid_request(f"request body is not valid UTF-8: {exc.reason}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise invalid_request(f"malformed JSON body: {exc.msg} at char {exc.pos}") from None
    except ValueError as exc:  # an integer of more than 4300 digits (int_max_str_digits)
        raise invalid_request(f"malformed JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise invalid_request("the request body must be a JSON object")
    return data


def parse_body(raw: bytes, schema: type[RequestT], limits: Limits) -> RequestT:
    """Decode, parse and validate a JSON body; raises RouterError (400) naming the problem."""
    try:
        request = schema.model_validate(_json_object(raw))
    except ValidationError as exc:
        raise _validation_error(exc) from None
    request.check_unsupported()
    check_caps(request, limits)
    return request


def _validation_error(exc: ValidationError) -> RouterError:
    # A union field fails once per member; the deepest location is the most specific one.
    errors = exc.errors()
    if any(e["loc"][:1] == ("prompt",) and e["type"].endswith("_type") for e in errors):
        errors = _prompt_errors(errors)
        if not errors:  # no shape fits: name the shapes, not one union member's complaint
            return invalid_request(_PROMPT_SHAPES, param="prompt")
    first = max(errors, key=lambda e: len(e["loc"]))
    loc = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    param = ".".join(loc) or None
    message = first["msg"].removeprefix("Value error, ")
    return invalid_request(f"{param}: {message}" if param else message, param=param)


def _prompt_errors(errors: list[Any]) -> list[Any]:
    """The errors of the prompt shape the client meant, judged by the first element (a list
    starting with an int meant token ids, …); none when no shape fits."""
    whole = next((e["input"] for e in errors if len(e["loc"]) == 2), None)  # the str member's
    if isinstance(whole, str):  # a text the str member refused on its value
        return [e for e in errors if len(e["loc"]) == 2]
    if not isinstance(whole, list) or not whole:
        return []
    meant = {int: "list[int]", str: "list[function-after", list: "list[list[int]]"}
    tag = meant.get(type(whole[0]))
    return [e for e in errors if tag and str(e["loc"][1]).startswith(tag) and len(e["loc"]) > 2]


_PROMPT_SHAPES = (
    "prompt must be a string, a list of token ids, a list of strings, or a list of token-id lists"
)


def _is_type_tag(part: str | int) -> bool:
    """Union members add their type to the location ("prompt.list[int].1"): not a field."""
    text = str(part)
    return "[" in text or text.startswith("function-") or text in _TYPE_TAGS


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def check_caps(request: _SamplingRequest, limits: Limits) -> None:
    """The request within the caps of ``router.limits`` (the one table, which
    ``RouterCore.prepare`` checks again for gRPC too), named as the client named them;
    max_tokens is checked with the prompt."""
    if isinstance(request, CompletionRequest) and len(request.prompts()) > limits.max_prompts:
        raise invalid_request(f"at most {limits.max_prompts} prompts in one request", "prompt")
    stops = [request.stop] if isinstance(request.stop, str) else request.stop
    values = {
        "n": request.n,
        "logprobs": request.num_logprobs(),  # type: ignore[attr-defined]
        "prompt_logprobs": request.prompt_logprobs,
        "stop": stops,
        "stop_token_ids": request.stop_token_ids,
    }
    chat = isinstance(request, ChatCompletionRequest)
    check_bounds(values, limits, {"logprobs": "top_logprobs"} if chat else None)
    if isinstance(request, CompletionRequest) and request.use_beam_search:
        check_beam_width(request.beam_width, limits)


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
            prompt_logprobs=request.num_prompt_logprobs(),  # type: ignore[attr-defined]
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured_outputs_of(request),
        )
    except ValueError as exc:
        raise invalid_request(str(exc), param=param_of(str(exc))) from None


def structured_outputs_of(request: _SamplingRequest) -> StructuredOutputsParams | None:
    """The request's one grammar spec, from whichever field carries it; 400 on two, or on a
    spec that is malformed on its face (a schema that is not a JSON object, a regex Python
    cannot parse). What only compiling reveals is refused by the node's engine (400 too); the
    router never imports xgrammar (it pulls in torch)."""
    specs = _structured_specs(request)
    if len(specs) > 1:
        raise invalid_request(
            f"give one structured output spec, got {', '.join(sorted(specs))}",
            param=sorted(specs)[0],
        )
    if not specs:
        return None
    [(param, spec)] = specs.items()
    _check_spec(param, spec)
    try:
        return StructuredOutputsParams(**spec)
    except ValueError as exc:
        raise invalid_request(f"{param}: {exc}", param=param) from None


def _structured_specs(request: _SamplingRequest) -> dict[str, dict[str, Any]]:
    """param name → StructuredOutputsParams keyword arguments, for every field that is set."""
    specs: dict[str, dict[str, Any]] = {}
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        specs["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid_request(
                "response_format.json_schema.schema is required", "response_format"
            )
        specs["response_format"] = {"json": fmt.json_schema.schema_}
    so = request.structured_outputs
    if so is not None:
        fields = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar}
        spec: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
        if so.json_object:
            spec["json_object"] = True
        if spec:  # a spec of its own; else only options for the others' (vLLM's use)
            specs["structured_outputs"] = spec
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            specs[f"guided_{kind}"] = {kind: value}
    if so is not None and so.disable_any_whitespace:  # with response_format too
        for spec in specs.values():
            spec["disable_any_whitespace"] = True
    return specs


def _check_spec(param: str, spec: dict[str, Any]) -> None:
    schema = spec.get("json")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            msg = f"{param}: the JSON schema is not JSON: {exc.msg}"
            raise invalid_request(msg, param) from None
    if schema is not None and not isinstance(schema, dict):
        raise invalid_request(f"{param}: a JSON schema must be a JSON object", param)
    if spec.get("regex") is not None:
        try:
            re.compile(spec["regex"])
        except re.error as exc:
            raise invalid_request(f"{param}: invalid regex: {exc}", param) from None


def param_of(message: str) -> str | None:
    """The field a SamplingParams message is about ("top_p must be ..." → "top_p",
    "temperature=1e+300 is out of range" → "temperature")."""
    head = re.match(r"[A-Za-z_]\w*(?=[ =])", message)
    return head.group(0) if head else None
