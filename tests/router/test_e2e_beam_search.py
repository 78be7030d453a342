"""Beam search through a real router and real nodes (``use_beam_search`` on /v1/completions):
the prompt prefilled once, the beams decoded on one decode node, the ``n`` best hypotheses equal
to the offline ``LLM.beam_search`` (itself equal to HF ``generate(num_beams=…)``,
tests/engine/test_beam_search.py). Every test ends with all KV blocks free on every node."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from common.beam_search import BeamSearchParams
from tests.router.conftest import Cluster, wait_no_leaks

MODEL = "tiny-llama"
TEXT_PROMPT = "Once upon a time, in a small village by the sea,"
IDS_PROMPT = [1, *range(400, 440)]  # 41 tokens: two full blocks and a partial one


@pytest.fixture(autouse=True)
def _no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{cluster.router.base_url}/v1", api_key="unused", max_retries=0, timeout=180
    )


@pytest.mark.parametrize(
    ("width", "n", "max_tokens", "length_penalty", "prompt"),
    [
        (1, 1, 8, 1.0, IDS_PROMPT),
        (2, 2, 10, 1.0, TEXT_PROMPT),
        (4, 2, 12, 0.5, IDS_PROMPT),
        (4, 3, 6, 1.0, TEXT_PROMPT),
        (3, 1, 1, 1.0, IDS_PROMPT),  # one token: the prefill's candidates decide it
    ],
    ids=["w1", "w2", "w4-lp0.5", "w4-n3", "w3-one-token"],
)
def test_beam_search_matches_offline(  # type: ignore[no-untyped-def]
    cluster: Cluster, offline, width: int, n: int, max_tokens: int, length_penalty: float, prompt
) -> None:
    params = BeamSearchParams(width, max_tokens, length_penalty)
    [want] = offline.beam_search([prompt], params, use_tqdm=False)
    result = client(cluster).completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, n=n, temperature=0.0,
        extra_body={"use_beam_search": True, "best_of": width, "length_penalty": length_penalty},
    )  # fmt: skip
    got = [(c.index, c.text, c.finish_reason) for c in result.choices]
    assert got == [(i, s.text, s.finish_reason) for i, s in enumerate(want.sequences[:n])]
    assert result.usage is not None
    assert result.usage.completion_tokens == sum(
        len(s.output_token_ids) for s in want.sequences[:n]
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True, "best_of": 2, "n": 3}, "best_of"),
        ({"use_beam_search": True, "best_of": 5}, "best_of"),  # over --max-n (4 here)
        ({"use_beam_search": True, "best_of": 2, "stream": True}, "stream"),
        ({"use_beam_search": True, "best_of": 2, "logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "best_of": 2, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "best_of": 2, "presence_penalty": 0.5}, "presence_penalty"),
        (
            {"use_beam_search": True, "best_of": 2, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        ({"length_penalty": 0.5}, "length_penalty"),  # without use_beam_search
        ({"best_of": 2}, "best_of"),  # without use_beam_search: best_of == n
    ],
)
def test_beam_search_refusals(cluster: Cluster, extra: dict, param: str) -> None:
    body = {"model": MODEL, "prompt": IDS_PROMPT, "max_tokens": 4, **extra}
    response = httpx.post(f"{cluster.router.base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_still_refuses_beam_search(cluster: Cluster) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "use_beam_search": True}  # fmt: skip
    response = httpx.post(f"{cluster.router.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "use_beam_search"
