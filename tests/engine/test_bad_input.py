"""Bad input raises a clear ValueError and leaves the engine usable."""

import pytest

from common import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", max_model_len=128, max_n=4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n must be"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 128, SamplingParams(), "max_model_len"),
        ([1, 2, 10**6], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1, 2, 3], SamplingParams(n=5), "over its cap"),
    ],
)
def test_bad_requests_leave_engine_usable(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([[5, 6, 7], prompt], params, use_tqdm=False)
    llm.check_integrity()
    assert not llm.engine.has_unfinished()
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_unknown_model_path():
    with pytest.raises(ValueError, match="unknown model"):
        LLM(model="/nonexistent/model-dir")


def test_unknown_engine_argument():
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM(model="tiny-llama", block_sise=16)
