"""Request validation (types, caps, encodings) and response/SSE formatting, no nodes."""

from __future__ import annotations

import json

import pytest

from common.request import TokenLogprobs
from router.errors import RouterError
from router.flow import Usage
from router.openai_format import (
    DONE,
    ChatFormatter,
    ChoiceResult,
    CompletionFormatter,
    EchoPrompt,
    sse,
)
from router.openai_models import (
    ChatCompletionRequest,
    CompletionRequest,
    Limits,
    parse_body,
    requested_max_tokens,
    to_sampling_params,
)
from router.sample import SampleDelta

LIMITS = Limits(max_n=4, max_logprobs=5)


def completion(**fields: object) -> bytes:
    return json.dumps({"model": "tiny-llama", "prompt": "hi", **fields}).encode()


def chat(**fields: object) -> bytes:
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


BAD_COMPLETIONS = [
    (b"{not json", None, "malformed JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"prompt": "\xff\xfe"}', None, "UTF-8"),
    (b'{"prompt": "\\ud800"}', "prompt", "UTF-8"),
    (completion(max_tokens="8"), "max_tokens", "integer"),
    (completion(max_tokens=1.5), "max_tokens", "integer"),
    (completion(n=True), "n", "integer"),
    (completion(temperature="hot"), "temperature", "number"),
    (completion(prompt=[1, "a"]), "prompt.1", "integer"),
    (completion(prompt=None), "prompt", None),
    (completion(prompt=[]), "prompt", "empty"),
    (completion(stream="yes"), "stream", "boolean"),
    (completion(n=5), "n", "[1, 4]"),
    (completion(n=0), "n", "[1, 4]"),
    (completion(logprobs=6), "logprobs", "[0, 5]"),
    (completion(stop=["x"] * 17), "stop", "stop strings"),
    (completion(top_p=0), "top_p", "top_p"),
    (completion(temperature=-1), "temperature", "temperature"),
    (completion(seed=-3), "seed", "seed"),
    (completion(max_tokens=0), "max_tokens", "max_tokens"),
    (completion(min_tokens=9, max_tokens=4), "min_tokens", "min_tokens"),
    (completion(suffix="x"), "suffix", "suffix"),
    (completion(logit_bias={"5": 1.0}), "logit_bias", "logit_bias"),
    (completion(best_of=3), "best_of", "best_of"),
    (completion(stream_options={"include_usage": True}), "stream_options", "stream"),
]


@pytest.mark.parametrize(("raw", "param", "needle"), BAD_COMPLETIONS)
def test_bad_completion_bodies_are_400(raw: bytes, param: str | None, needle: str | None) -> None:
    with pytest.raises(RouterError) as info:
        request = parse_body(raw, CompletionRequest, LIMITS)
        to_sampling_params(request, requested_max_tokens(request))
    error = info.value
    assert error.status == 400 and error.param == param
    if needle:
        assert needle in error.message
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}


BAD_CHATS = [
    (chat(messages=[]), "messages"),
    (chat(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role"),
    (chat(messages=[{"role": "user", "content": 5}]), "messages.0.content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content"),
    (chat(logprobs=True, top_logprobs=6), "top_logprobs"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(tools=[{"type": "function"}]), "tools"),
]


@pytest.mark.parametrize(("raw", "param"), BAD_CHATS)
def test_bad_chat_bodies_are_400(raw: bytes, param: str) -> None:
    with pytest.raises(RouterError) as info:
        parse_body(raw, ChatCompletionRequest, LIMITS)
    assert info.value.status == 400 and (info.value.param or "").startswith(param)


def test_vllm_extras_reach_sampling_params() -> None:
    raw = completion(
        prompt=[1, 2, 3],
        ignore_eos=True,
        top_k=5,
        min_p=0.1,
        repetition_penalty=1.2,
        min_tokens=2,
        seed=7,
        stop_token_ids=[9],
        skip_special_tokens=False,
        stop="END",
        include_stop_str_in_output=True,
        unknown_field="ignored",
    )
    request = parse_body(raw, CompletionRequest, LIMITS)
    params = to_sampling_params(request, requested_max_tokens(request))
    assert request.prompt == [1, 2, 3]
    assert (params.top_k, params.min_p, params.repetition_penalty) == (5, 0.1, 1.2)
    assert (params.min_tokens, params.seed, params.max_tokens) == (2, 7, 16)
    assert params.ignore_eos and not params.skip_special_tokens
    assert params.stop == ["END"] and params.stop_token_ids == [9]
    assert params.include_stop_str_in_output


def test_chat_defaults() -> None:
    request = parse_body(chat(logprobs=True, top_logprobs=3), ChatCompletionRequest, LIMITS)
    params = to_sampling_params(request, requested_max_tokens(request))
    assert params.max_tokens is None and params.logprobs == 3
    request = parse_body(chat(max_completion_tokens=9), ChatCompletionRequest, LIMITS)
    assert requested_max_tokens(request) == 9


# ----------------------------------------------------------------------------- formatting


class FakePrompts:
    def token_text(self, token_id: int) -> str:
        return f"<{token_id}>"


def test_sse_framing() -> None:
    assert sse({"a": 1}) == b'data: {"a":1}\n\n'
    assert DONE == b"data: [DONE]\n\n"


def test_completion_chunks_and_usage() -> None:
    fmt = CompletionFormatter(
        "cmpl-1", "m", 5, FakePrompts(), logprobs=True, include_usage=True,
        echo=[EchoPrompt("P:", [5, 6])],
    )  # fmt: skip
    lp = [TokenLogprobs(7, -0.5, [7, 8], [-0.5, -1.0])]
    prompt_lp = [None, TokenLogprobs(6, -2.0, [3], [-0.1])]
    first = fmt.chunk(SampleDelta(0, [7], "x", lp, prompt_logprobs=prompt_lp))
    assert first["object"] == "text_completion" and first["usage"] is None
    choice = first["choices"][0]
    assert choice["text"] == "P:x" and choice["finish_reason"] is None
    assert choice["logprobs"] == {  # the echoed prompt's tokens first, the first without one
        "tokens": ["<5>", "<6>", "<7>"],
        "token_logprobs": [None, -2.0, -0.5],
        "top_logprobs": [None, {"<6>": -2.0, "<3>": -0.1}, {"<7>": -0.5, "<8>": -1.0}],
        "text_offset": [0, 3, 6],
    }
    last = fmt.chunk(SampleDelta(0, [9], "y", [TokenLogprobs(9, -0.1)], "stop", "END"))
    assert last["choices"][0]["text"] == "y"  # echo only once
    assert last["choices"][0]["logprobs"]["text_offset"] == [9]
    # logprobs=0: top_logprobs holds the chosen token, as vLLM answers
    assert last["choices"][0]["logprobs"]["top_logprobs"] == [{"<9>": -0.1}]
    assert last["choices"][0]["stop_reason"] == "END"
    usage = fmt.usage_chunk(Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 5
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_continuous_usage_and_vllm_prompt_logprobs() -> None:
    fmt = CompletionFormatter(
        "cmpl-1", "m", 5, FakePrompts(), logprobs=False, include_usage=True,
        continuous_usage=True, prompt_logprobs=True, n=2,
    )  # fmt: skip
    prompt_lp = [None, TokenLogprobs(6, -2.0, [3], [-0.1])]
    chunk = fmt.chunk(SampleDelta(3, [7], "x", prompt_logprobs=prompt_lp), Usage(4, 1))
    assert chunk["usage"]["total_tokens"] == 5 and chunk["usage"]["completion_tokens"] == 1
    assert chunk["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "6": {"logprob": -2.0, "rank": None, "decoded_token": "<6>"},
            "3": {"logprob": -0.1, "rank": 1, "decoded_token": "<3>"},
        },
    ]


def test_chat_chunks_open_with_role_and_response_shape() -> None:
    fmt = ChatFormatter("chatcmpl-1", "m", 5, FakePrompts(), logprobs=False, include_usage=False)
    first = fmt.chunk(SampleDelta(1, [7], "he"))
    assert first["object"] == "chat.completion.chunk" and "usage" not in first
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "he"}
    assert fmt.chunk(SampleDelta(1, [8], "llo"))["choices"][0]["delta"] == {"content": "llo"}
    result = ChoiceResult()
    result.add(SampleDelta(0, [7], "he"))
    result.add(SampleDelta(0, [8], "llo", finish_reason="length"))
    body = fmt.response([result], Usage(prompt_tokens=1, completion_tokens=2))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 2


def test_response_format_takes_disable_any_whitespace_from_structured_outputs() -> None:
    """vLLM's form: ``response_format`` names the schema, ``structured_outputs`` carries only
    the option (it was refused as a second spec)."""
    from router.openai_models import structured_outputs_of

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = chat(
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        structured_outputs={"disable_any_whitespace": True},
    )
    spec = structured_outputs_of(parse_body(body, ChatCompletionRequest, LIMITS))
    assert spec is not None and spec.disable_any_whitespace and json.loads(spec.json) == schema
    plain = chat(response_format={"type": "json_object"})
    spec = structured_outputs_of(parse_body(plain, ChatCompletionRequest, LIMITS))
    assert spec is not None and spec.json_object and not spec.disable_any_whitespace
    with pytest.raises(RouterError, match="give one structured output spec"):
        two = chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a+"})
        structured_outputs_of(parse_body(two, ChatCompletionRequest, LIMITS))
