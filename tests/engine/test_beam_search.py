"""Beam search equals HF transformers' ``generate(num_beams=…)``, token for token and score for
score; its beams share their prefix blocks through the prefix cache; no block outlives it."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

from common import LLM
from common.beam_search import (
    BeamSearch,
    BeamSearchParams,
    BeamSearchSequence,
    TopLogprobs,
    length_penalised,
)
from common.models.tiny import resolve_model_path
from tests.engine.hf_reference import random_prompts

WIDTHS = (1, 2, 4, 8)
# a divergence passes only where HF scores both hypotheses within this of each other
NEAR_TIE = 1e-4
# our logprob sum vs the one behind HF's sequences_scores, for the same hypothesis. Compared as
# sums, the quantity the engine computes: a length penalty of -0.5 multiplies a score by up to
# sqrt(12): a hold-out's score of -72.705 once came out 1.1e-4 from HF's, its sum within this
SCORE_TOL = 1e-4


def hf_beams(model, prompt: list[int], width: int, max_new: int, length_penalty: float, **kw):
    """HF's hypotheses (output ids, best first) and their scores (None for width 1: greedy)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        length_penalty=length_penalty,
        return_dict_in_generate=True,
        output_scores=True,
        **kw,
    )
    seqs = out.sequences[:, len(prompt) :].tolist()
    if width == 1:  # greedy: one sequence, cut at its EOS
        return seqs, None
    lengths = (out.beam_indices != -1).sum(dim=1).tolist()  # the rest is padding
    return [s[:n] for s, n in zip(seqs, lengths)], out.sequences_scores.tolist()


def hf_score(model, prompt: list[int], output: list[int], length_penalty: float) -> float:
    """HF's score of one hypothesis: float32 logprob sum over the length to the penalty."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    lp = logits.log_softmax(-1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)
    return (lp.sum() / len(output) ** length_penalty).item()


def assert_same_beams(model, prompt, ours: list[BeamSearchSequence], theirs, scores, lp, eos):
    """Equal hypotheses in the same order with HF's scores; a divergence passes only at a
    near-tie that HF's own scores prove (later ranks then legitimately differ)."""
    assert len(ours) == len(theirs)
    for i, (seq, want) in enumerate(zip(ours, theirs)):
        got = seq.output_token_ids
        ended = bool(got) and got[-1] in eos
        assert seq.finish_reason == ("stop" if ended else "length")
        if got != want:
            a, b = hf_score(model, prompt, got, lp), hf_score(model, prompt, want, lp)
            assert abs(a - b) < NEAR_TIE, f"rank {i}: ours {got} ({a}), HF {want} ({b})"
            return
        if scores is not None:  # the penalty is an exact transform of the sum: checked apart
            assert seq.cum_logprob == pytest.approx(scores[i] * len(got) ** lp, abs=SCORE_TOL)
            assert seq.score == length_penalised(np.float32(seq.cum_logprob), len(got), lp)


def assert_no_leak(llm: LLM) -> None:
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks


def check_against_hf(llm, hf, prompts, width, max_new, lp, ignore_eos=False) -> list:
    params = BeamSearchParams(width, max_new, length_penalty=lp, ignore_eos=ignore_eos)
    outputs = llm.beam_search(prompts, params, use_tqdm=False)
    eos = set() if ignore_eos else set(llm.engine.eos_token_ids)
    kw = {"eos_token_id": None} if ignore_eos else {}
    for prompt, out in zip(prompts, outputs):
        assert out.prompt_token_ids == prompt
        theirs, scores = hf_beams(hf, prompt, width, max_new, lp, **kw)
        try:
            assert_same_beams(hf, prompt, out.sequences, theirs, scores, lp, eos)
        except AssertionError:
            # Batched with other prompts' beams (or after a prefix hit) a prompt is computed in
            # other GEMM shapes than HF's batch of one, and those last bits can flip a near-tie
            # at a pruning step several rounds before the hypotheses differ (seen on an AMD
            # EPYC box), which the final scores cannot show. Alone and from a cold cache the
            # same search must then give HF's hypotheses exactly; a wrong search fails here too.
            # The batched hypotheses are still this prompt's, scored as HF scores them:
            for seq in out.sequences:
                got = hf_score(hf, prompt, seq.output_token_ids, 0.0)
                assert seq.cum_logprob == pytest.approx(got, abs=1e-3), seq.output_token_ids
            llm.engine.kv_cache_manager.reset_prefix_cache()
            (alone,) = llm.beam_search([prompt], params, use_tqdm=False)
            assert_same_beams(hf, prompt, alone.sequences, theirs, scores, lp, eos)
    assert_no_leak(llm)
    return outputs


def load_hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_beam_search_matches_hf_quick():
    """The fast one: tiny-llama, one prompt, widths 1 and 4."""
    hf = load_hf(resolve_model_path("tiny-llama"))
    prompts = random_prompts(1024, 1, (20, 40), seed=5)
    with LLM(model="tiny-llama", block_size=16, num_blocks=256) as llm:
        for width in (1, 4):
            check_against_hf(llm, hf, prompts, width, 6, 1.0)


def test_beam_search_text_and_context_limit():
    """A text prompt is tokenized and each hypothesis's output decoded; ``max_tokens`` is cut to
    the room ``max_model_len`` leaves; a prompt that leaves none is refused, holding nothing."""
    with LLM(model="tiny-llama", block_size=16, num_blocks=64, max_model_len=40) as llm:
        (out,) = llm.beam_search("the cat sat", BeamSearchParams(2, 4), use_tqdm=False)
        assert out.prompt_token_ids == llm.tokenizer.encode("the cat sat")
        for seq in out.sequences:
            assert seq.tokens[: len(out.prompt_token_ids)] == out.prompt_token_ids
            assert seq.text == llm.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        (cut,) = llm.beam_search([[5] * 36], BeamSearchParams(2, 10, ignore_eos=True))
        assert [len(s.output_token_ids) for s in cut.sequences] == [4, 4]
        with pytest.raises(ValueError, match="no room"):
            llm.beam_search([[5] * 10, [5] * 40], BeamSearchParams(2, 4), use_tqdm=False)
        assert_no_leak(llm)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_beam_search_matches_hf_tiny_models(name):
    path = resolve_model_path(name)
    hf = load_hf(path)
    prompts = random_prompts(hf.config.vocab_size, 3, (1, 60), seed=6)
    with LLM(model=name, block_size=16, num_blocks=512) as llm:
        for width in WIDTHS:
            for lp in (1.0, 0.0, 2.0):
                check_against_hf(llm, hf, prompts, width, 10, lp)


ENGINE_MODES = {
    "overlapped": {"async_scheduling": True},
    # rounds spread over several steps (chunked), beams competing for blocks
    "tight": {
        "num_blocks": 40,
        "max_num_batched_tokens": 48,
        "max_num_seqs": 6,
        "max_model_len": 256,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_beam_search_engine_modes(mode):
    hf = load_hf(resolve_model_path("tiny-llama"))
    prompts = random_prompts(1024, 2, (50, 90), seed=12)
    with LLM(model="tiny-llama", block_size=16, **ENGINE_MODES[mode]) as llm:
        check_against_hf(llm, hf, prompts, 8, 10, 1.0)


EOS_PULL = 1.5  # how far the hold-out model's EOS row leans to its mean hidden state


def write_hold_out(path, seed: int = 7) -> list[int]:
    """A random Llama written by transformers (shapes no built-in model has), whose first EOS
    id is pulled towards the model's mean hidden state so that beams end at it often (~6 % of
    positions rank it first, ~30 % in the top 16); a second, ordinary EOS id too. Returns the
    EOS ids."""
    torch.manual_seed(seed)
    eos = [2, 5]
    config = LlamaConfig(
        vocab_size=1024,
        hidden_size=96,
        intermediate_size=224,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.25,  # HF's 0.02 gives near-uniform logits: ties everywhere
        rope_theta=5000.0,
        bos_token_id=1,
        eos_token_id=eos,
        pad_token_id=3,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        prompts = random_prompts(1024, 8, (5, 30), seed=seed)
        hidden = torch.cat([model.model(torch.tensor([p])).last_hidden_state[0] for p in prompts])
        mean = hidden.mean(0)
        spread = model.lm_head(hidden).std()
        model.lm_head.weight[eos[0]] = EOS_PULL * spread * mean / mean.norm() ** 2
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=eos, pad_token_id=3)
    model.save_pretrained(path)
    tokenizer_dir = resolve_model_path("tiny-llama")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tokenizer_dir / name, path / name)
    return eos


@pytest.fixture(scope="module")
def hold_out(tmp_path_factory):
    path = tmp_path_factory.mktemp("hold_out")
    eos = write_hold_out(path)
    return path, eos, load_hf(path)


@pytest.mark.slow
@pytest.mark.parametrize("lp", [1.0, 2.0, -0.5])
def test_beam_search_matches_hf_hold_out(hold_out, lp):
    """EOS ends beams here (two EOS ids: K = 3 x width candidates): hypotheses of every
    length, HF's length normalisation deciding between them."""
    path, eos, hf = hold_out
    prompts = random_prompts(1024, 3, (3, 50), seed=8)
    ended = 0
    with LLM(model=str(path), block_size=16, num_blocks=512) as llm:
        assert llm.engine.eos_token_ids == eos
        for width in WIDTHS:
            outputs = check_against_hf(llm, hf, prompts, width, 12, lp)
            ended += sum(s.finish_reason == "stop" for o in outputs for s in o.sequences)
    assert ended > 0  # the EOS path ran


@pytest.mark.slow
def test_beam_search_ignore_eos_hold_out(hold_out):
    """Where EOS ends hypotheses, ``ignore_eos`` runs every beam to ``max_tokens``, as HF with
    ``eos_token_id=None`` does."""
    path, _, hf = hold_out
    prompts = random_prompts(1024, 3, (3, 50), seed=8)
    ended = 0
    with LLM(model=str(path), block_size=16, num_blocks=512) as llm:
        for width in (1, 4):
            stopping = llm.beam_search(prompts, BeamSearchParams(width, 12), use_tqdm=False)
            ended += sum(s.finish_reason == "stop" for o in stopping for s in o.sequences)
            outputs = check_against_hf(llm, hf, prompts, width, 12, 1.0, ignore_eos=True)
            assert all(len(s.output_token_ids) == 12 for o in outputs for s in o.sequences)
    assert ended > 0


def spy_steps(llm: LLM, monkeypatch) -> list[tuple[int, int, int]]:
    """Per engine step: (requests, tokens computed, tokens the requests hold)."""
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule
    steps: list[tuple[int, int, int]] = []

    def spy(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if not out.is_empty:
            held = sum(s.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
            steps.append((len(out.scheduled), out.num_batched_tokens, held))
        return out

    monkeypatch.setattr(scheduler, "schedule", spy)
    return steps


def test_beams_share_prefix_blocks(monkeypatch):
    """At block size 1 every round computes one token per beam: the prefix cache hands each
    beam its parent's blocks. At 16, at most a block's worth per beam, never the prefix."""
    hf = load_hf(resolve_model_path("tiny-llama"))
    prompt = random_prompts(1024, 1, (60, 60), seed=10)[0]
    width, max_new = 4, 8
    for block_size in (1, 16):
        with LLM(model="tiny-llama", block_size=block_size, num_blocks=4096 // block_size) as llm:
            steps = spy_steps(llm, monkeypatch)
            check_against_hf(llm, hf, [prompt], width, max_new, 1.0, ignore_eos=True)
        assert len(steps) == max_new  # one engine step per round
        assert steps[0] == (1, len(prompt), len(prompt))
        for t, (requests, computed, held) in enumerate(steps[1:], start=1):
            assert requests == width
            assert held == width * (len(prompt) + t)  # what recomputing would cost
            if block_size == 1:
                assert computed == width
            else:
                assert width <= computed <= width * block_size


def fake_tops(scores: dict[int, float], k: int) -> TopLogprobs:
    best = sorted(scores, key=lambda t: -scores[t])[:k]
    return TopLogprobs(best, [scores[t] for t in best])


def test_hypothesis_ending_below_the_top_width_is_dropped():
    """HF's rule: an EOS candidate counts only when it ranks in the top ``width``; beams go on
    with the best non-ending candidates."""
    search = BeamSearch([7], BeamSearchParams(2, 5), eos_token_ids=[2], max_tokens=5)
    assert search.num_logprobs == 4
    search.advance([fake_tops({10: -0.1, 11: -0.2, 2: -0.3, 12: -0.4}, 4)])
    assert search.finished == [] and [b.output for b in search.running] == [(10,), (11,)]
    search.advance(
        [fake_tops({2: -0.05, 13: -0.5}, 4), fake_tops({14: -0.1, 15: -0.9}, 4)]
    )  # ranks: 10+2 (ends, top 2), 11+14, 10+13, 11+15
    assert [h.beam.output for h in search.finished] == [(10, 2)]
    assert search.finished[0].score == pytest.approx((-0.1 - 0.05) / 2)
    assert [b.output for b in search.running] == [(11, 14), (10, 13)]
    assert not search.done


def test_search_stops_when_no_running_beam_can_win():
    """HF's heuristic: once ``width`` hypotheses exist, the search ends when the best running
    beam, scored at the current length, does not beat the worst of them."""
    search = BeamSearch([7], BeamSearchParams(2, 9), eos_token_ids=[2], max_tokens=9)
    search.advance([fake_tops({2: -0.1, 3: -0.2, 10: -1.0, 11: -1.1}, 4)])
    assert not search.done  # one hypothesis of two
    search.advance([fake_tops({2: -0.05, 12: -3.0}, 4), fake_tops({13: -3.0, 14: -3.1}, 4)])
    # hypotheses (2,) at -0.1 and (3, 2) at -0.125; best running (3, 12): -3.2 / 2 < -0.125
    assert search.done
    seqs = search.sequences()
    assert [s.output_token_ids for s in seqs] == [[2], [3, 2]]
    assert [s.finish_reason for s in seqs] == ["stop", "stop"]


def test_width_one_is_greedy_to_the_first_eos():
    search = BeamSearch([7], BeamSearchParams(1, 5), eos_token_ids=[2], max_tokens=5)
    assert search.num_logprobs == 1
    search.advance([TopLogprobs([9], [-0.5])])
    search.advance([TopLogprobs([2], [-0.25])])
    assert search.done
    (seq,) = search.sequences()
    assert seq.output_token_ids == [9, 2] and seq.finish_reason == "stop"
    assert seq.cum_logprob == -0.75 and seq.score == pytest.approx(-0.375)


def test_length_penalty_rounds_as_torch():
    """The penalised score is HF's float32 tensor divided by a Python float."""
    values = torch.randn(1000) * 20
    for length, penalty in ((1, 0.7), (3, 0.7), (7, -0.5), (12, 2.0)):
        want = (values / (length**penalty)).tolist()
        got = [float(length_penalised(v, length, penalty)) for v in values.numpy()]
        assert got == want
