"""The OpenAI surface clients rely on, through the official ``openai`` client and raw HTTP on an
in-process router with fake nodes: models.retrieve, /tokenize ↔ /detokenize, /version,
/openapi.json, batched prompts (choice ``i*n + j``), echo with prompt logprobs and
``max_tokens=0``, ``logprobs=0``, stream usage, ``chat_template_kwargs``, refused parameters.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import openai
import pytest

from router.openai_models import UNSUPPORTED
from tests.router.fakes import fake_prompt_logprob, fake_token
from tests.router.inproc import Harness, running_router

MODEL = "tiny-llama"


def run(test: Callable[[Harness], Awaitable[None]]) -> None:
    async def main() -> None:
        async with running_router() as harness:
            await test(harness)

    asyncio.run(main())


def client(h: Harness) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://router/v1", api_key="unused", http_client=h.http, max_retries=0
    )


def seeds(h: Harness) -> list[int]:
    """The seed of every prefill the fake nodes saw, in arrival order."""
    return [r.sampling_params.seed for n in h.prefill for r in n.script.requests]  # type: ignore[attr-defined]


def test_models_retrieve_version_and_openapi() -> None:
    async def test(h: Harness) -> None:
        api = client(h)
        card = await api.models.retrieve(MODEL)
        assert card.id == MODEL and card.object == "model"
        with pytest.raises(openai.NotFoundError):
            await api.models.retrieve("no-such-model")
        version = (await h.http.get("/version")).json()
        assert isinstance(version["version"], str) and version["version"]
        spec = (await h.http.get("/openapi.json")).json()
        assert "/v1/completions" in spec["paths"] and "/tokenize" in spec["paths"]

    run(test)


@pytest.mark.parametrize(
    "text", ["Hello, world!", "Once upon a time, in a small village by the sea,", "ünïcode ✓"]
)
def test_tokenize_detokenize_round_trip(text: str) -> None:
    async def test(h: Harness) -> None:
        tokens = (await h.http.post("/tokenize", json={"model": MODEL, "prompt": text})).json()
        ids = h.router.core.prompts.tokenizer.encode(text)
        assert tokens["tokens"] == ids and tokens["count"] == len(ids)
        assert tokens["max_model_len"] == 4096 and tokens["token_strs"] is None
        back = (await h.http.post("/detokenize", json={"model": MODEL, "tokens": ids})).json()
        assert back["prompt"] == h.router.core.prompts.tokenizer.decode(ids)
        assert text in back["prompt"]  # only the BOS is added
        bare = await h.http.post(
            "/tokenize",
            json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
        )
        assert bare.json()["tokens"] == ids[1:] and len(bare.json()["token_strs"]) == len(ids) - 1

    run(test)


def test_tokenize_chat_and_bad_bodies() -> None:
    async def test(h: Harness) -> None:
        messages = [{"role": "user", "content": "Hi"}]
        got = (await h.http.post("/tokenize", json={"messages": messages})).json()
        rendered = h.router.core.prompts.render_chat(messages, True)
        assert got["tokens"] == h.router.core.prompts.encode_chat(rendered)
        both = await h.http.post("/tokenize", json={"prompt": "a", "messages": messages})
        assert both.status_code == 400
        bad = await h.http.post("/detokenize", json={"tokens": [10**9]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"

    run(test)


def test_batch_of_string_prompts() -> None:
    async def test(h: Harness) -> None:
        prompts = ["The cat", "A dog barks", "Rain"]
        result = await client(h).completions.create(
            model=MODEL, prompt=prompts, max_tokens=3, n=2, seed=7, temperature=0.0
        )
        assert [c.index for c in result.choices] == list(range(6))
        assert len(seeds(h)) == 6
        assert result.usage is not None and result.usage.completion_tokens == 6 * 3
        encode = h.router.core.prompts.tokenizer.encode
        assert result.usage.prompt_tokens == sum(len(encode(p)) for p in prompts)  # once per prompt
        prompt_of = {tuple(r.prompt_token_ids) for n in h.prefill for r in n.script.requests}  # type: ignore[attr-defined]
        assert prompt_of == {tuple(encode(p)) for p in prompts}

    run(test)


def test_batch_of_token_id_prompts_streamed_and_not() -> None:
    async def test(h: Harness) -> None:
        prompts = [[1, 400, 401], [1, 500], [1, 600, 601, 602]]
        api = client(h)
        result = await api.completions.create(model=MODEL, prompt=prompts, max_tokens=4, seed=3)
        assert [c.index for c in result.choices] == [0, 1, 2]
        want = "".join(h.router.core.prompts.decode([fake_token(3, i) for i in range(4)]))
        assert all(c.text == want for c in result.choices)  # same seed, same fake tokens
        stream = await api.completions.create(
            model=MODEL, prompt=prompts, max_tokens=4, seed=3, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        texts = {0: "", 1: "", 2: ""}
        chunks = [chunk async for chunk in stream]
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert texts == {0: want, 1: want, 2: want}
        assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 9

    run(test)


def test_bad_batches_name_the_prompt() -> None:
    async def test(h: Harness) -> None:
        for prompt, param, needle in [
            (["a", 1], "prompt.1", "string"),
            ([[1, 2], []], "prompt", "prompt.1 is empty"),
            ({"a": 1}, "prompt", "a list of token-id lists"),
            (["x"] * 65, "prompt", "at most 64 prompts"),
        ]:
            r = await h.http.post("/v1/completions", json={"prompt": prompt})
            error = r.json()["error"]
            assert r.status_code == 400 and error["param"] == param, error
            assert needle in error["message"], error

    run(test)


def test_echo_logprobs_and_max_tokens_zero_score_the_prompt() -> None:
    async def test(h: Harness) -> None:
        prompts = [[1, 400, 401, 402], [1, 500, 501]]
        body = {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 0}
        r = await h.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        for choice, ids in zip(r.json()["choices"], prompts):
            lp = choice["logprobs"]
            assert choice["finish_reason"] == "length"
            # echoed whole, special tokens too (vLLM)
            assert choice["text"] == h.router.core.prompts.decode(ids, skip_special_tokens=False)
            assert lp["token_logprobs"] == [None, *[fake_prompt_logprob(t) for t in ids[1:]]]
            assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
            assert len(lp["tokens"]) == len(ids)
        assert r.json()["usage"]["completion_tokens"] == 0
        # lm-eval's shape: max_tokens=1, the generated token follows the prompt's
        body = {"prompt": ["Hi there"], "echo": True, "logprobs": 1, "max_tokens": 1}
        one = (await h.http.post("/v1/completions", json=body)).json()["choices"][0]
        ids = h.router.core.prompts.tokenizer.encode("Hi there")
        assert len(one["logprobs"]["tokens"]) == len(ids) + 1
        assert one["logprobs"]["token_logprobs"][0] is None

    run(test)


def test_vllm_prompt_logprobs_field() -> None:
    async def test(h: Harness) -> None:
        body = {"prompt": [1, 400, 401], "max_tokens": 2, "prompt_logprobs": 0}
        choice = (await h.http.post("/v1/completions", json=body)).json()["choices"][0]
        assert choice["prompt_logprobs"][0] is None
        assert choice["prompt_logprobs"][1]["400"]["logprob"] == fake_prompt_logprob(400)
        messages = [{"role": "user", "content": "Hi"}]
        body = {"messages": messages, "max_tokens": 2, "prompt_logprobs": 1}
        chat = (await h.http.post("/v1/chat/completions", json=body)).json()
        assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"][1]) == 2

    run(test)


def test_max_tokens_zero_needs_echo() -> None:
    async def test(h: Harness) -> None:
        r = await h.http.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"

    run(test)


def test_logprobs_zero_gives_the_sampled_token() -> None:
    async def test(h: Harness) -> None:
        result = await client(h).completions.create(
            model=MODEL, prompt=[1, 400], max_tokens=3, logprobs=0, seed=5
        )
        logprobs = result.choices[0].logprobs
        assert logprobs is not None and logprobs.top_logprobs is not None
        assert logprobs.tokens is not None and len(logprobs.top_logprobs) == 3
        for token, top in zip(logprobs.tokens, logprobs.top_logprobs):
            assert list(top) == [token]

    run(test)


def test_stream_usage_continuous_and_final() -> None:
    async def test(h: Harness) -> None:
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {"prompt": [1, 400], "max_tokens": 4, "stream": True, "stream_options": options}
        async with h.http.stream("POST", "/v1/completions", json=body) as r:
            events = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        with_choices = [c for c in chunks if c["choices"]]
        assert all(c["usage"]["prompt_tokens"] == 2 for c in with_choices)
        assert [c["usage"]["completion_tokens"] for c in with_choices] == [1, 2, 3, 4]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 6

    run(test)


def test_chat_template_kwargs_reach_the_template() -> None:
    async def test(h: Harness) -> None:
        prompts = h.router.core.prompts
        template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tag | default('') }}"
        prompts.tokenizer.chat_template = template
        messages = [{"role": "user", "content": "Hi"}]
        body = {"messages": messages, "max_tokens": 1, "chat_template_kwargs": {"tag": " X!"}}
        r = await h.http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        [request] = [r for n in h.prefill for r in n.script.requests]  # type: ignore[attr-defined]
        assert list(request.prompt_token_ids) == prompts.encode_chat("Hi X!")
        bad = {"messages": messages, "chat_template_kwargs": {"tokenize": True}}
        refused = await h.http.post("/v1/chat/completions", json=bad)
        assert refused.json()["error"]["param"] == "chat_template_kwargs"

    run(test)


REFUSED: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/chat/completions",
        {"use_beam_search": True},
    ),  # completions: tests/router/test_flow_beams.py
    ("/v1/completions", {"allowed_token_ids": [1, 2]}),
    ("/v1/completions", {"truncate_prompt_tokens": 3}),
    ("/v1/completions", {"add_special_tokens": False}),
    ("/v1/completions", {"suffix": "x"}),
    ("/v1/completions", {"logit_bias": {"5": 1.0}}),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {"tool_choice": "auto"}),
    ("/v1/chat/completions", {"continue_final_message": True}),
    ("/v1/chat/completions", {"chat_template": "{{ messages }}"}),
    ("/v1/chat/completions", {"reasoning_effort": "low"}),
]


def test_unsupported_parameters_are_refused_by_name() -> None:
    async def test(h: Harness) -> None:
        base = {
            "/v1/completions": {"prompt": "a", "max_tokens": 1},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "a"}]},
        }
        for path, extra in REFUSED:
            r = await h.http.post(path, json={**base[path], **extra})
            [name] = extra
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (extra, r.text)
        # defaults and nulls pass, as do fields neither API defines
        for path, extra in [
            ("/v1/completions", {"use_beam_search": False, "allowed_token_ids": None}),
            ("/v1/completions", {"add_special_tokens": True, "not_a_param": 1}),
            ("/v1/chat/completions", {"tool_choice": "none", "add_special_tokens": False}),
        ]:
            r = await h.http.post(path, json={**base[path], "max_tokens": 1, **extra})
            assert r.status_code == 200, (extra, r.text)
        assert "use_beam_search" in UNSUPPORTED

    run(test)


def test_prompt_logprobs_is_null_when_not_asked() -> None:
    """vLLM sends ``prompt_logprobs: null``; clients (and vLLM's own tests) read the key."""

    async def test(h: Harness) -> None:
        api = client(h)
        result = await api.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert result.choices[0].prompt_logprobs is None  # type: ignore[attr-defined]
        chat = await api.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
        assert chat.prompt_logprobs is None  # type: ignore[attr-defined]

    run(test)


def test_echo_of_token_ids_keeps_special_tokens() -> None:
    async def test(h: Harness) -> None:
        prompt = [1, 400, 401]  # 1 is <s>
        result = await client(h).completions.create(
            model=MODEL, prompt=prompt, max_tokens=1, echo=True, seed=3
        )
        echoed = h.router.core.prompts.tokenizer.decode(prompt, skip_special_tokens=False)
        assert result.choices[0].text.startswith(echoed) and echoed.startswith("<s>")

    run(test)


def test_partial_utf8_tokens_carry_their_raw_bytes() -> None:
    """A token that is part of a multi-byte character: its label is ``bytes:\\xNN`` of the
    token's bytes (vLLM's form), and chat's ``bytes`` are those bytes, not the label's."""

    async def test(h: Harness) -> None:
        prompts = h.router.core.prompts
        ids = prompts.tokenizer.encode("✓", add_special_tokens=False)
        whole = b"".join(prompts.token_bytes(i) for i in ids)
        assert whole == "✓".encode()
        partial = [i for i in ids if "\ufffd" in prompts.tokenizer.decode([i])]
        assert partial, "the tiny tokenizer splits ✓ into byte tokens"
        label = prompts.token_text(partial[0])
        raw = prompts.token_bytes(partial[0])
        assert label == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    run(test)


def test_chat_continue_final_message_and_echo() -> None:
    """vLLM's chat extras: the last (assistant) message left open and continued, and echoed
    in front of the reply."""

    async def test(h: Harness) -> None:
        messages = [
            {"role": "user", "content": "Tell me a story."},
            {"role": "assistant", "content": "Once upon a time"},
        ]
        prompts = h.router.core.prompts
        open_ended = prompts.render_chat(messages, False, None, continue_final_message=True)
        closed = prompts.render_chat(messages, False, None)
        assert open_ended.endswith("Once upon a time") and closed != open_ended
        api = client(h)
        reply = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, seed=1,  # type: ignore[arg-type]
            extra_body={"continue_final_message": True, "add_generation_prompt": False,
                        "echo": True},
        )  # fmt: skip
        content = reply.choices[0].message.content or ""
        assert content.startswith("Once upon a time") and len(content) > len("Once upon a time")
        seen = [r.prompt_token_ids for n in h.prefill for r in n.script.requests]  # type: ignore[attr-defined]
        assert list(seen[-1]) == prompts.encode_chat(open_ended)
        with pytest.raises(openai.BadRequestError, match="add_generation_prompt"):
            await api.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=3,  # type: ignore[arg-type]
                extra_body={"continue_final_message": True},
            )  # fmt: skip

    run(test)
