"""Penalty counts kept on the device: slots built once, new tokens counted by the fused sampler,
the same tokens as penalties recomputed from the whole token lists every step."""

from __future__ import annotations

import pytest
import torch

from common import LLM, SamplingParams
from common import penalty_counts as penalty_module
from common.penalty_counts import PenaltyCounts, SlotRow
from common.sampler import Sampler, SampleRow


def upload(values, dtype, device):
    return torch.as_tensor(values, dtype=dtype).to(device)


def row(request_id, prompt, output, **penalties) -> SampleRow:
    params = SamplingParams(temperature=0.0, **(penalties or {"repetition_penalty": 1.2}))
    return SampleRow(params, 1, len(output), list(prompt), list(output), None, request_id)


def test_a_slot_is_built_once_then_fed_new_tokens() -> None:
    counts = PenaltyCounts(10, torch.device("cpu"), upload)
    first = counts.assign([row("a", [1, 1, 2], [3, 3]), None])
    assert first == [SlotRow(0, ()), None]
    assert counts.counts[0].tolist() == [0, -(2**15), -(2**15), 2, 0, 0, 0, 0, 0, 0]
    # the next step hands over only the outputs not counted yet
    assert counts.assign([row("a", [1, 1, 2], [3, 3, 4])]) == [SlotRow(0, (4,))]
    assert counts.counts[0, 4] == 0  # counted by the sampler's kernel, not here
    counts.check_integrity()


@pytest.mark.parametrize("rows", [1, 8, 9, 100, 256])
def test_the_counts_never_outgrow_what_the_memory_profile_sets_aside(rows: int) -> None:
    """``rows`` penalised requests in one step, the worst case, reached one request at a time
    (every doubling happens): the slots tensor plus the old one it copies from while it doubles
    stay within ``reserved_bytes``, which that last doubling reaches exactly."""
    vocab = 10
    counts = PenaltyCounts(vocab, torch.device("cpu"), upload)
    peak, before = 0, 0
    for n in range(1, rows + 1):
        counts.assign([row(f"r{i}", [1], [2]) for i in range(n)])
        now = counts.counts.numel() * 2
        peak = max(peak, now + (before if now > before else 0))
        before = now
    assert peak <= penalty_module.reserved_bytes(rows, vocab)
    if rows > 8:
        assert peak == penalty_module.reserved_bytes(rows, vocab)


def test_slots_of_absent_requests_are_reused_least_recent_first() -> None:
    counts = PenaltyCounts(10, torch.device("cpu"), upload)
    counts.assign([row(r, [1], []) for r in "abcdefgh"])  # the first 8 slots
    counts.assign([row(r, [1], []) for r in "abcdefg"])  # h is the least recent now
    assert counts.assign([row("z", [5], [])]) == [SlotRow(7, ())]
    assert counts.counts[7].tolist() == [0, 0, 0, 0, 0, -(2**15), 0, 0, 0, 0]
    # a step holding more requests than slots doubles the tensor
    out = counts.assign([row(r, [1], []) for r in "abcdefgzy"])
    assert [s.slot for s in out] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert counts.counts.shape == (16, 10)
    counts.check_integrity()


def test_rows_without_an_id_or_with_many_new_tokens_are_built_again() -> None:
    counts = PenaltyCounts(10, torch.device("cpu"), upload)
    counts.assign([row("a", [1], [2])])
    out = counts.assign([row("a", [1], [2, 3, 4, 5, 6, 7]), row(None, [1], [2, 2])])
    assert out == [SlotRow(0, ()), SlotRow(1, ())]  # "a" rebuilt in its own slot
    assert counts.counts[0, 2:8].tolist() == [1] * 6
    assert counts.counts[1, 2] == 2
    counts.check_integrity()


def test_the_sampler_counts_new_tokens_in_its_slots() -> None:
    sampler = Sampler()
    logits = torch.zeros(1, 10)
    logits[0, 3] = 1.0
    first = row("a", [], [], frequency_penalty=0.6)
    assert sampler.sample(logits, [first]).token_ids.tolist() == [3]
    # after one 3 the penalty is 0.6: 1.0 - 0.6 > 0; after two, 1.0 - 1.2 < 0: token 0 wins
    second = row("a", [], [3], frequency_penalty=0.6)
    assert sampler.sample(logits, [second]).token_ids.tolist() == [3]
    third = row("a", [], [3, 3], frequency_penalty=0.6)
    assert sampler.sample(logits, [third]).token_ids.tolist() == [0]
    assert sampler._penalties is not None and sampler._penalties.counts[0, 3] == 2


@pytest.fixture(scope="module")
def llm():
    return LLM(model="tiny-llama", max_num_batched_tokens=64)


def _generate(llm) -> list[list[int]]:
    prompts = [[11, 12, 13, 11, 12] * 3, [7, 7, 8] * 5, [20 + i for i in range(17)]]
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.4, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, frequency_penalty=0.7, seed=5, max_tokens=24),
        SamplingParams(temperature=0.8, top_k=20, presence_penalty=1.1, seed=9, max_tokens=24),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_kept_counts_give_the_tokens_of_whole_lists(llm, monkeypatch) -> None:
    """The same requests, once with device counts kept between steps, once penalised from the
    whole prompt and output lists each step (the eager path): token for token."""
    kept = _generate(llm)
    monkeypatch.setattr(penalty_module, "MAX_OUTPUTS", 0)  # every step takes the eager path
    assert _generate(llm) == kept
    counts = llm.engine.runner.sampler._penalties
    assert counts is not None and counts.counts.shape[0] >= 3
    counts.check_integrity()


@pytest.mark.slow  # two engines: 94 s measured at a load average of 8
def test_speculative_rows_with_penalties_equal_plain_decoding() -> None:
    """n-gram drafts: a request's first row keeps its counts (accepted drafts arrive as several
    new tokens at once), the draft rows after it are built from their lists each step."""
    from tests.engine.test_spec_decode import NGRAM, PROMPTS

    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=32),
        SamplingParams(temperature=0.8, frequency_penalty=0.5, presence_penalty=0.3, seed=4,
                       max_tokens=32),
    ] * (len(PROMPTS) // 2) + [SamplingParams(temperature=0.0, max_tokens=32)] * (len(PROMPTS) % 2)  # fmt: skip
    plain = LLM(model="tiny-llama").generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model="tiny-llama", speculative_config=NGRAM)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().spec_num_drafts > 0
    llm.engine.runner.sampler._penalties.check_integrity()
