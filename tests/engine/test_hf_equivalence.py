"""Greedy output equals HF transformers `generate`, token for token, under every scheduling mode."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import LLM, SamplingParams
from tests.engine.hf_reference import assert_same_greedy, hf_greedy, random_prompts

MAX_NEW = 24
NUM_PROMPTS = 16


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def reference(request):
    """(model name, prompts, HF model, HF outputs) per built-in model."""
    from common.models.tiny import resolve_model_path

    path = resolve_model_path(request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    prompts = random_prompts(vocab, NUM_PROMPTS, (1, 150), seed=1)
    # a shared system-prompt-like prefix on half of them exercises prefix-cache hits
    shared = random_prompts(vocab, 1, (40, 40), seed=2)[0]
    prompts[NUM_PROMPTS // 2 :] = [shared + p for p in prompts[NUM_PROMPTS // 2 :]]
    expected = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    return request.param, prompts, hf, expected


ENGINE_MODES = {
    "default": {},
    "chunked": {"max_num_batched_tokens": 48},
    "preemption": {"num_blocks": 30, "max_num_batched_tokens": 256, "max_model_len": 256},
    "no_prefix_cache": {"enable_prefix_caching": False, "max_num_seqs": 3},
    # step N+1 scheduled and run before step N's tokens are read (the CUDA default)
    "overlapped": {"async_scheduling": True},
    "overlapped_preemption": {
        "async_scheduling": True,
        "num_blocks": 30,
        "max_num_batched_tokens": 256,
        "max_model_len": 256,
    },
}


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_greedy_matches_hf(reference, mode):
    name, prompts, hf, expected = reference
    llm = LLM(model=name, block_size=16, **ENGINE_MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, want in zip(prompts, outputs, expected):
        assert_same_greedy(hf, prompt, out.outputs[0].token_ids, want)
    if "preemption" in mode:
        assert llm.engine.scheduler.num_preemptions > 0
    # second pass: every prompt now hits the prefix cache (or is recomputed), same tokens
    again = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outputs]
    if mode != "no_prefix_cache":
        assert sum(o.num_cached_tokens for o in again) > 0
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks
