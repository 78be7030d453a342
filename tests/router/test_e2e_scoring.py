"""Prompt scoring end to end (real router, prefill and decode nodes): ``echo`` with
``logprobs`` and ``max_tokens=0`` returns the prompt's logprobs computed by the prefill node,
equal to HF transformers' log_softmax of the tiny model's logits within 1e-4; a batch of
token-id prompts goes through the official ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.router.conftest import Cluster, wait_no_leaks

MODEL = "tiny-llama"
TOLERANCE = 1e-4
PROMPTS = [[1, *range(400, 440)], [1, 700, 701, 702, 703], [1, *range(300, 320)]]


@pytest.fixture(autouse=True)
def _no_leaks(cluster: Cluster) -> Iterator[None]:
    yield
    wait_no_leaks(cluster)


@pytest.fixture(scope="module")
def hf_logprobs() -> list[torch.Tensor]:
    from common.models.tiny import resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_path(MODEL)), dtype=torch.float32
    ).eval()
    with torch.no_grad():
        return [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in PROMPTS]


def test_echo_logprobs_max_tokens_zero_match_hf(
    cluster: Cluster, hf_logprobs: list[torch.Tensor]
) -> None:
    api = openai.OpenAI(base_url=f"{cluster.router.base_url}/v1", api_key="x", max_retries=0)
    result = api.completions.create(
        model=MODEL, prompt=PROMPTS, echo=True, logprobs=2, max_tokens=0, temperature=0.0
    )
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert result.usage is not None and result.usage.completion_tokens == 0
    for choice, prompt, want in zip(result.choices, PROMPTS, hf_logprobs):
        assert choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(prompt) and lp.token_logprobs[0] is None
        for pos in range(1, len(prompt)):
            assert abs(lp.token_logprobs[pos] - want[pos - 1, prompt[pos]].item()) < TOLERANCE
            best = max(lp.top_logprobs[pos].values())
            assert abs(best - want[pos - 1].max().item()) < TOLERANCE
    # lm-eval's request: max_tokens=1 scores the prompt and adds the generated token
    one = api.completions.create(
        model=MODEL, prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=1, temperature=0.0
    )
    lp = one.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == len(PROMPTS[1]) + 1
    got = lp.token_logprobs[1 : len(PROMPTS[1])]
    want = [hf_logprobs[1][i - 1, PROMPTS[1][i]].item() for i in range(1, len(PROMPTS[1]))]
    assert max(abs(a - b) for a, b in zip(got, want)) < TOLERANCE
