"""Prompt logprobs (vLLM's ``prompt_logprobs``) equal HF transformers' log_softmax of the
prompt's logits within 1e-4, chunked or not, with and without overlapped steps; a request
asking for them skips the prefix cache (every position is computed), and their top k are HF's."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import LLM, SamplingParams
from tests.engine.hf_reference import random_prompts

TOLERANCE = 1e-4
MODES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 48},  # prompts of up to 150 span several steps
    "overlapped": {"async_scheduling": True},
}


@pytest.fixture(scope="module")
def reference():
    from common.models.tiny import resolve_model_path

    hf = AutoModelForCausalLM.from_pretrained(
        str(resolve_model_path("tiny-llama")), dtype=torch.float32
    ).eval()
    prompts = random_prompts(hf.config.vocab_size, 6, (1, 150), seed=3)
    prompts.append(prompts[0] + prompts[1])  # its head is in the prefix cache by now
    with torch.no_grad():
        want = [torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1) for p in prompts]
    return prompts, want


@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_match_hf(reference, mode):
    prompts, want = reference
    llm = LLM(model="tiny-llama", block_size=16, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    llm.generate(prompts[:2], SamplingParams(max_tokens=1), use_tqdm=False)  # fill the cache
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, lp in zip(prompts, outputs, want):
        got = out.prompt_logprobs
        assert got is not None and len(got) == len(prompt) and got[0] is None
        assert out.num_cached_tokens == 0  # no prefix-cache hit: every position computed
        for pos in range(1, len(prompt)):
            item, row = got[pos], lp[pos - 1]  # logits at pos - 1 score token pos
            assert item is not None and item.token_id == prompt[pos]
            assert abs(item.logprob - row[prompt[pos]].item()) < TOLERANCE
            top = torch.topk(row, 3)
            assert torch.allclose(torch.tensor(item.top_logprobs), top.values, atol=TOLERANCE)
    plain = llm.generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert plain[0].prompt_logprobs is None
    llm.engine.check_integrity()
