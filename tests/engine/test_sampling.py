"""Sampler: seeded streams independent of batch composition, filters, penalties, logprobs."""

import dataclasses
import math

import pytest
import torch

from common import LLM, SamplingParams
from common.sampler import Sampler, SampleRow, exponential_noise
from common.sampling_params import child_seed


def row(params: SamplingParams, seed=1, position=0, prompt=(), output=(), eos=None) -> SampleRow:
    return SampleRow(params, seed, position, list(prompt), list(output), eos)


def test_noise_is_a_pure_function_of_seed_position_token():
    seeds = torch.tensor([5, 5, 6, 2**62 + 3])
    positions = torch.tensor([0, 1, 0, 7])
    a = exponential_noise(seeds, positions, 100)
    b = exponential_noise(seeds[[2, 0]], positions[[2, 0]], 100)
    assert torch.equal(a[[2, 0]], b)  # batch order and composition do not matter
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert (a > 0).all() and a.isfinite().all()
    many = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.long), 4096)
    assert abs(many.mean().item() - 1.0) < 0.02  # Exp(1) has mean 1


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log()[None].repeat(3000, 1)
    rows = [row(SamplingParams(temperature=1.0), seed=i) for i in range(3000)]
    tokens = Sampler().sample(logits, rows).token_ids
    freq = torch.bincount(tokens, minlength=3).float() / 3000
    assert torch.allclose(freq, probs, atol=0.03)


def test_top_k_top_p_min_p_greedy():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).repeat(400, 1)
    s = Sampler()
    for params, allowed in [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_p=0.5), {0}),
        (SamplingParams(top_p=0.8), {0, 1}),
        (SamplingParams(min_p=0.3), {0, 1}),
        (SamplingParams(temperature=0.0), {0}),
    ]:
        tokens = s.sample(logits, [row(params, seed=i) for i in range(400)]).token_ids
        assert set(tokens.tolist()) == allowed, params


def test_penalties_and_min_tokens():
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.0]])
    s = Sampler()
    greedy = dict(temperature=0.0)
    rep = row(SamplingParams(repetition_penalty=2.0, **greedy), prompt=[0])
    assert s.sample(logits, [rep]).token_ids.item() == 1  # 2.0/2 < 1.9
    freq = row(SamplingParams(frequency_penalty=0.1, **greedy), output=[0, 0])
    assert s.sample(logits, [freq]).token_ids.item() == 1  # 2.0 - 0.2 < 1.9
    pres = row(SamplingParams(presence_penalty=0.05, **greedy), output=[0, 0])
    assert s.sample(logits, [pres]).token_ids.item() == 0  # 2.0 - 0.05 > 1.9
    mt = row(SamplingParams(min_tokens=2, **greedy), position=1, eos=0)
    assert s.sample(logits, [mt]).token_ids.item() == 1  # EOS banned below min_tokens


def test_logprobs_of_chosen_and_top():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    out = Sampler().sample(logits, [row(SamplingParams(temperature=0.0, logprobs=2))])
    ref = torch.log_softmax(logits, -1)[0]
    assert out.token_ids.item() == 2
    assert math.isclose(out.logprobs.item(), ref[2].item(), rel_tol=1e-6)
    assert out.top_ids[0].tolist() == [2, 1]


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", max_num_batched_tokens=64)


def test_seeded_sampling_independent_of_batch(llm):
    target = [11, 12, 13, 14, 15] * 7
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [[i + 3] * (5 + 13 * i) for i in range(9)]
    mixed_params = [SamplingParams(temperature=0.7, max_tokens=30, seed=i) for i in range(9)]
    crowd = llm.generate(
        [*others[:4], target, *others[4:]],
        [*mixed_params[:4], params, *mixed_params[4:]],
        use_tqdm=False,
    )
    assert crowd[4].outputs[0].token_ids == alone
    llm.check_integrity()


def test_n_samples_differ_and_are_reproducible(llm):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    out = llm.generate([[5] * 21], params, use_tqdm=False)[0]
    samples = [o.token_ids for o in out.outputs]
    assert len(samples) == 4 and all(len(s) == 12 for s in samples)
    assert len({tuple(s) for s in samples}) > 1
    for i, tokens in enumerate(samples):  # sample i is the request seeded child_seed(7, i)
        single = dataclasses.replace(params, n=1, seed=child_seed(7, i))
        assert llm.generate([[5] * 21], single, use_tqdm=False)[0].outputs[0].token_ids == tokens
    assert child_seed(7, 0) == 7  # sample 0 samples what the request with n == 1 samples
    again = llm.generate([[5] * 21], params, use_tqdm=False)[0]
    assert [o.token_ids for o in again.outputs] == samples
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks


def test_n_greedy_samples_are_the_greedy_output(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    want = llm.generate([[9, 8, 7, 6]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    greedy.n = 3
    out = llm.generate([[9, 8, 7, 6]], greedy, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.token_ids for o in out.outputs] == [want] * 3


def test_n_samples_compute_their_prompt_once(llm):
    """An n=4 request computes about one prompt, not four: the siblings of the first sample hit
    its full prompt blocks and compute only the last partial one (block size 16)."""
    prompt = list(range(300, 370))  # 70 tokens: 4 full blocks + 6, chunked by a budget of 64
    params = SamplingParams(n=4, temperature=1.0, max_tokens=1, seed=3)
    before = llm.engine.scheduler.num_scheduled_tokens
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert llm.engine.scheduler.num_scheduled_tokens - before == 70 + 3 * 6
    assert out.num_cached_tokens == 0  # sample 0's: nothing was cached before it
    llm.check_integrity()


def test_stop_strings_and_stop_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = llm.generate(["Once upon a time"], greedy, use_tqdm=False)[0].outputs[0]
    assert len(base.text) > 6
    stop = base.text[3:6]
    cut = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == base.text[: base.text.index(stop)]
    tok = base.token_ids[5]
    by_id = llm.generate(
        ["Once upon a time"],
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[tok]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(tok) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok
    llm.check_integrity()
