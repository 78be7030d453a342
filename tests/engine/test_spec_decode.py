"""Speculative decoding: proposals, verification, rollback, and output identical to plain
decoding (greedy and seeded) under chunked prefill, prefix hits, preemption and stops."""

import numpy as np
import pytest

from common.config import EngineConfig, SchedulerConfig
from common.cuda_graphs import DecodeGraphs, capture_sizes
from common.kv_cache_manager import KVCacheManager
from common.llm import LLM
from common.request import Request
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.spec_decode import SpeculativeConfig, num_accepted
from common.spec_decode.ngram import NgramProposer, propose_ngram
from common.spec_decode.rejection import wants_drafts
from common.step_outputs import SampledToken

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}

# repetitive (prompt lookup applies), plain, and ragged lengths; two share a long prefix
PROMPTS = [
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the",
    "one two three four one two three four one two three four one two",
    "hello world",
    "a b a b a b a b a b a b a b a b a b a b a b a b a b a b a",
    "the cat sat on the mat. the cat sat on the mat. the dog ran",
    "x",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor " * 3,
    "def f(x): return x + 1\ndef g(x): return x + 2\ndef h(x): return x +",
    # 8 more, ragged: prefix hits on the first ones, a long one that chunks, tiny ones
    "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the cat",
    "one two three four one two three four five six",
    "SELECT name FROM users; SELECT name FROM users; SELECT",
    "ab",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor " * 4,
    "red green blue red green blue red green blue red green",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "<li>a</li><li>b</li><li>a</li><li>b</li><li>",
]


# -- the proposer and the acceptance rule ---------------------------------------------------
def test_ngram_proposes_the_continuation_of_the_latest_match():
    t = np.array([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert propose_ngram(t, 2, 1, 3).tolist() == [7, 8]  # latest "1 2 3"
    assert propose_ngram(t, 7, 1, 3).tolist() == [7, 8, 1, 2, 3, 7, 8]  # its loop goes on
    assert propose_ngram(t, 2, 4, 4).tolist() == []  # no 4-gram match
    assert propose_ngram(np.array([5, 6, 7]), 3, 1, 2).tolist() == []
    assert propose_ngram(np.array([4, 4, 4, 4]), 3, 1, 3).tolist() == [4, 4, 4]


def test_ngram_prefers_the_longest_suffix():
    t = np.array([3, 5, 0, 2, 3, 5, 1, 4, 2, 3, 5])
    assert propose_ngram(t, 1, 1, 3).tolist() == [1]  # "2 3 5" beats the later "3 5"


def test_num_accepted():
    assert num_accepted([4, 5, 6], [4, 5, 6, 7]) == 3
    assert num_accepted([4, 5, 6], [4, 9, 6, 7]) == 1
    assert num_accepted([4], [3, 1]) == 0


def test_config_from_dict():
    cfg = EngineConfig.from_kwargs(speculative_config={"method": "ngram", "prompt_lookup_min": 2})
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 3, 2)
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.from_dict({"method": "ngram", "k": 3})
    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig.from_dict({"method": "draft_model"})


# -- scheduler: budget, rollback, stops (fake runner, exact block ids) ------------------------
BS = 4


def _sched(budget=16, num_blocks=32):
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=4)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), max_model_len=1024)


def _decoding(sched, n_prompt=6, max_tokens=20, stop_ids=()):
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_ids))
    req = Request(
        "r", list(range(n_prompt)), params, eos_token_id=None, block_size=BS, seed=0,
        max_tokens=max_tokens,
    )  # fmt: skip
    sched.add_request(req)
    out = sched.schedule()
    sched.update_from_output(out, {"r": SampledToken(100)})
    return req


def _verify(sched, req, drafts, targets):
    req.spec_token_ids = list(drafts)
    out = sched.schedule()
    (item,) = out.scheduled
    verified = {"r": [SampledToken(t) for t in targets[: len(item.spec_token_ids) + 1]]}
    return item, sched.update_from_output(out, {}, verified)


def test_rejected_drafts_roll_back_their_slots_and_blocks():
    sched = _sched()
    req = _decoding(sched)  # 6 prompt tokens + 1 output: 7 tokens, 6 computed, 2 blocks
    assert sched.kv.get_block_ids("r") == [0, 1]
    item, (res,) = _verify(sched, req, [1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 9, 9, 9])
    assert item.num_new_tokens == 7 and item.num_computed_tokens == 6
    assert res.new_token_ids == [1, 2, 9]  # two drafts kept, then the target's own token
    assert req.num_tokens == 10 and req.num_computed_tokens == 9
    assert sched.kv.get_block_ids("r") == [0, 1, 2]  # block 3 (rejected slots 12, 13) freed
    assert sched.kv.num_free_blocks == 29
    stats = sched.stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens) == (1, 6)
    assert stats.spec_num_accepted_tokens == 2
    assert stats.spec_mean_accepted_length == 3.0
    sched.check_integrity()


def test_drafts_that_keep_missing_back_off_and_one_accepted_draft_resets():
    """n verifications in a row accepting nothing: no drafts for the next 2**(n-1) tokens."""
    sched = _sched(num_blocks=64)
    req = _decoding(sched, max_tokens=200)
    skips = []
    for _ in range(4):
        assert wants_drafts(req, 3) == 3
        _verify(sched, req, [1, 2, 3], [9, 9, 9, 9])  # none accepted: one token (the target's)
        skips.append(req.spec_resume_at - req.num_output_tokens)
        while not wants_drafts(req, 3):  # plain decode steps meanwhile
            out = sched.schedule()
            sched.update_from_output(out, {"r": SampledToken(100)})
    assert skips == [1, 2, 4, 8]
    _verify(sched, req, [1, 2, 3], [1, 9, 9, 9])  # one accepted: the back-off ends
    assert (req.spec_misses, wants_drafts(req, 3)) == (0, 3)
    sched.check_integrity()


def test_lookups_that_find_nothing_back_off_and_a_match_resets():
    sched = _sched(num_blocks=64)
    req = _decoding(sched, max_tokens=200)  # prompt 0..5, then 100: nothing repeats
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 3, 1))
    fresh = iter(range(200, 400))
    skips = []

    def decode(token: int) -> None:
        out = sched.schedule()
        sched.update_from_output(out, {"r": SampledToken(token)})

    for _ in range(5):
        while not wants_drafts(req, 3):
            decode(next(fresh))
        proposer.propose([req])
        assert req.spec_token_ids == []
        skips.append(req.spec_resume_at - req.num_output_tokens)
    assert skips == [1, 2, 4, 8, 8]
    while not wants_drafts(req, 3):
        decode(next(fresh))
    decode(3)  # a token seen before: the lookup finds "4 5 100 …" after it
    proposer.propose([req])
    assert req.spec_token_ids[:1] == [4] and req.spec_lookup_misses == 0


def test_drafts_count_against_the_budget_and_max_tokens():
    sched = _sched(budget=4)
    req = _decoding(sched, n_prompt=3)
    item, (res,) = _verify(sched, req, [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6])
    assert item.spec_token_ids == [1, 2, 3]  # 1 + 3 drafts = the budget of 4
    assert res.new_token_ids == [1, 2, 3, 4]
    sched = _sched()
    req = _decoding(sched, max_tokens=3)  # one output so far: room for 2 more, so 1 draft
    item, (res,) = _verify(sched, req, [1, 2, 3], [1, 2, 3, 4])
    assert item.spec_token_ids == [1]
    assert res.new_token_ids == [1, 2] and res.finish_reason == "length"
    assert sched.kv.num_free_blocks == 32


def test_a_stop_token_inside_the_accepted_run_ends_it_there():
    sched = _sched()
    req = _decoding(sched, stop_ids=[7])
    _, (res,) = _verify(sched, req, [1, 7, 3], [1, 7, 3, 4])
    assert res.new_token_ids == [1, 7] and res.finish_reason == "stop"
    assert req.output_token_ids == [100, 1, 7]
    assert sched.kv.num_free_blocks == 32


# -- whole engine: identical output -------------------------------------------------------------
def _run(model, params, spec=None, graphs=None, **args):
    """``graphs``: a list the graph-shaped runner (``_graph_shaped``) appends to."""
    args = {"max_num_batched_tokens": 64, **args}
    llm = LLM(model=model, speculative_config=spec, **args)
    if graphs is not None:
        _graph_shaped(llm, graphs)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.kv_cache_manager.pool.num_blocks
    return [o.outputs[0] for o in outs], llm


GREEDY = SamplingParams(temperature=0.0, max_tokens=48, logprobs=2)


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def greedy_reference(request):
    outs, _ = _run(request.param, GREEDY)
    return request.param, outs


def _same(spec_outs, ref_outs):
    for s, r in zip(spec_outs, ref_outs):
        assert s.token_ids == r.token_ids
        assert s.finish_reason == r.finish_reason
        if r.logprobs is None:
            continue
        assert len(s.logprobs) == len(s.token_ids)
        for a, b in zip(s.logprobs, r.logprobs):
            assert a.token_id == b.token_id and a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


@pytest.mark.parametrize(
    "args",
    [{}, {"max_num_batched_tokens": 16}, {"num_blocks": 24, "max_model_len": 256}],
    ids=["plain", "chunked", "preemption"],
)
def test_greedy_ngram_equals_plain_decoding(greedy_reference, args):
    model, ref = greedy_reference
    outs, llm = _run(model, GREEDY, NGRAM, **args)
    _same(outs, ref)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0  # (random tiny models: acceptance is low, may be 0)
    if "num_blocks" in args:
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    "args",
    [{}, {"max_num_batched_tokens": 16}, {"num_blocks": 24, "max_model_len": 256}],
    ids=["plain", "chunked", "preemption"],
)
def test_greedy_ngram_equals_plain_when_lookup_is_right(bigram_model, args):
    """The bigram workload (``benchmarks/speculative.py --bigram``): greedy output cycles, so
    most drafts are accepted: long accepted runs, stops and rollbacks inside them, identical
    tokens and logprobs, every block free."""
    ref, _ = _run(bigram_model, GREEDY, **args)
    outs, llm = _run(bigram_model, GREEDY, NGRAM, **args)
    _same(outs, ref)
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > stats.spec_num_draft_tokens / 2


@pytest.fixture(scope="module")
def bigram_model():
    from benchmarks.speculative import bigram_checkpoint

    return str(bigram_checkpoint("tiny-llama"))


def _graph_shaped(llm: LLM, replayed: list) -> None:
    """Run the engine's decode and verification steps through the CUDA-graph path (padded,
    fixed-address, per-token attention rows; eager on CPU), recording each replay's
    ``(size, tokens verified)``."""
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model,
        runner.inputs,
        runner.block_size,
        capture_sizes(64),
        max_seq_len=runner.max_model_len,
        capture=False,
    )
    graphs.capture_all(runner.kv_layers)
    size_for = graphs.size_for

    def recording(scheduled):
        size = size_for(scheduled)
        if size is not None:
            replayed.append((size, sum(len(s.spec_token_ids) for s in scheduled)))
        return size

    graphs.size_for = recording
    runner.graphs = graphs


@pytest.mark.parametrize(
    "args",
    [{}, {"num_blocks": 24, "max_model_len": 256}, {"async_scheduling": True}],
    ids=["plain", "preemption", "overlapped"],
)
def test_verification_in_decode_graphs_equals_plain_decoding(bigram_model, args):
    """Verification steps replay the decode graphs (each draft its own attention row) and give
    plain decoding's tokens and logprobs; mostly accepted drafts (the bigram model) make every
    row count."""
    ref, _ = _run(bigram_model, GREEDY, **args)
    replayed = []
    outs, llm = _run(bigram_model, GREEDY, NGRAM, graphs=replayed, **args)
    _same(outs, ref)
    verified = [size for size, drafts in replayed if drafts]
    assert len(verified) > 10, replayed
    assert (
        llm.engine.stats().spec_num_accepted_tokens > llm.engine.stats().spec_num_draft_tokens / 2
    )


def test_verification_in_decode_graphs_reads_the_context(greedy_reference):
    """The random tiny models, whose tokens depend on every position attended to (the bigram
    model's mostly do not): greedy tokens and logprobs equal plain decoding's."""
    model, ref = greedy_reference
    replayed = []
    outs, _ = _run(model, GREEDY, NGRAM, graphs=replayed)
    _same(outs, ref)
    assert any(drafts for _, drafts in replayed), replayed


def test_seeded_verification_in_decode_graphs_equals_plain_seeded_sampling():
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=40) for i in range(8)
    ] + [SamplingParams(temperature=0.0, max_tokens=40)] * (len(PROMPTS) - 8)
    ref, _ = _run("tiny-llama", params)
    replayed = []
    outs, _ = _run("tiny-llama", params, NGRAM, graphs=replayed)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert any(drafts for _, drafts in replayed), replayed


def test_seeded_ngram_equals_plain_seeded_sampling():
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=40) for i in range(4)
    ] + [SamplingParams(temperature=0.0, max_tokens=40)] * (len(PROMPTS) - 4)
    llm_plain = LLM(model="tiny-llama")
    ref = llm_plain.generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(model="tiny-llama", speculative_config=NGRAM)
    for _ in range(2):  # reproducible across runs, and equal to non-speculative sampling
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.stats().spec_num_drafts > 0


def test_stop_ids_and_strings_inside_accepted_runs(greedy_reference):
    model, ref = greedy_reference
    params = []
    for r in ref:  # stop at the 10th token's id; stop strings in the middle of the text
        params.append(
            SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=[r.token_ids[9]])
        )
    outs, _ = _run(model, params, NGRAM)
    ref_outs, _ = _run(model, params)
    _same(outs, ref_outs)
    texts = [r.text for r in ref]
    params = [
        SamplingParams(temperature=0.0, max_tokens=48, stop=[t[len(t) // 2 : len(t) // 2 + 3]])
        if len(t) > 8 else SamplingParams(temperature=0.0, max_tokens=48)
        for t in texts
    ]  # fmt: skip
    outs, _ = _run(model, params, NGRAM)
    ref_outs, _ = _run(model, params)
    assert [o.text for o in outs] == [o.text for o in ref_outs]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref_outs]


def test_abort_mid_speculation_frees_every_block():
    llm = LLM(model="tiny-llama", speculative_config=NGRAM)
    for i, p in enumerate(PROMPTS):
        llm.engine.add_request(str(i), llm.tokenizer.encode(p), SamplingParams(max_tokens=64))
    for _ in range(6):
        llm.engine.step()
    llm.engine.abort(llm.engine.request_ids())
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.kv_cache_manager.pool.num_blocks


def test_draft_model_equals_plain_decoding(greedy_reference):
    model, ref = greedy_reference
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    outs, llm = _run(model, GREEDY, spec)
    _same(outs, ref)
    stats = llm.engine.stats()
    assert stats.spec_acceptance_rate == 1.0  # its own draft: every greedy draft is right
    assert stats.spec_mean_accepted_length > 2.0


def test_structured_outputs_with_ngram_equal_plain_sampling():
    """Proposals under a grammar: every verified row is masked after the drafts before it."""
    from common.sampling_params import StructuredOutputsParams

    specs = [{"regex": "(cat |dog ){4,12}end"}, {"choice": ["yes yes yes", "no no no no"]}]
    params = [
        SamplingParams(
            temperature=t, seed=i, max_tokens=64, structured_outputs=StructuredOutputsParams(**s)
        )
        for i, (s, t) in enumerate([(s, t) for s in specs for t in (0.0, 0.8)])
    ]
    prompts = ["cat dog cat dog cat dog"] * len(params)
    ref = LLM(model="tiny-llama").generate(prompts, params, use_tqdm=False)
    llm = LLM(model="tiny-llama", speculative_config=NGRAM)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ref]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    llm.check_integrity()


def test_node_flag_and_the_engine_core_config():
    """``--speculative-config`` on a node reaches the engine-core process intact."""
    import argparse

    from common.core_messages import engine_config_from_dict, engine_config_to_dict
    from node_frontend.options import add_node_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_node_arguments(parser, 50071)
    flag = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}'
    args = parser.parse_args(["--kv-store", "file:///tmp/x", "--speculative-config", flag])
    config = options_from_args(args, 50071, env={}).engine_config("consumer")
    assert config.speculative_config == SpeculativeConfig("ngram", 5, 4, 1)
    assert engine_config_from_dict(engine_config_to_dict(config)) == config
    for bad in ("{not json", "[1]", '{"method": "eagle"}'):
        args = parser.parse_args(["--kv-store", "file:///tmp/x", "--speculative-config", bad])
        with pytest.raises(ValueError):
            options_from_args(args, 50071, env={})


def test_acceptance_counters_reach_the_node_load_report():
    """EngineStats → the core's LoadStats → NodeLoad → LoadReport (heartbeat) and back."""
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto.convert import load_from_proto, load_to_proto, node_load_from_engine

    from common.core_messages import LoadStats

    stats = LoadStats(
        num_waiting=0, num_running=2, num_free_blocks=10, num_total_blocks=20,
        queued_prompt_tokens=0, spec_num_drafts=7, spec_num_draft_tokens=28,
        spec_num_accepted_tokens=12, query_id=1,
    )  # fmt: skip
    assert stats.spec_acceptance_rate == 12 / 28
    load = load_from_proto(load_to_proto(pb.ROLE_DECODE, node_load_from_engine(stats, 8, False)))
    counts = (load.spec_num_drafts, load.spec_num_draft_tokens, load.spec_num_accepted_tokens)
    assert counts == (7, 28, 12)
