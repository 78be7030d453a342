"""Tensor parallelism on CPU (gloo, 2 ranks): the same tokens as one device, 1/N of the weights
per rank, and a dead rank fails the engine instead of hanging it.

Each model starts one TP=2 engine (two processes) for the whole module: start-up dominates.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import pytest

from common import LLM, SamplingParams
from common.models.tiny import write_hf_checkpoint
from common.parallel.executor import TensorParallelError, weight_bytes
from tests.engine.test_spec_decode import _graph_shaped

ENGINE_ARGS = dict(
    max_num_batched_tokens=16,  # prompts of 40 tokens prefill in chunks
    num_blocks=64,
    block_size=8,
    enable_prefix_caching=True,
    cpu_threads=1,
    max_model_len=256,
)
SHARED = list(range(10, 42))  # 32 tokens = 4 blocks of prefix shared by two prompts
PROMPTS = [
    [1, 5, 9, 33, 2, 7],
    [*SHARED, 3, 4, 5, 6, 7, 8, 9, 10],
    [*SHARED, 50, 51, 52],
    list(range(100, 140)),
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def gqa_dir(tmp_path_factory):
    """Llama with 8 query heads over 2 KV heads (GQA 4:1), two safetensors shards."""
    config = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    out = tmp_path_factory.mktemp("gqa") / "tiny-gqa"
    return str(write_hf_checkpoint(out, config, "llama", seed=3, shards=2))


def run(llm: LLM) -> list[list[int]]:
    """Greedy (twice: the second pass hits the prefix cache) and seeded sampling."""
    tokens = []
    for params in (GREEDY, GREEDY, SEEDED):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
    return tokens


def _check_model(model: str) -> tuple[LLM, LLM]:
    single = LLM(model=model, **ENGINE_ARGS)
    parallel = LLM(model=model, tensor_parallel_size=2, **ENGINE_ARGS)
    assert run(parallel) == run(single)
    parallel.check_integrity()
    return single, parallel


def _replicated_bytes(single: LLM) -> int:
    """Bytes every rank holds whole: norms, o_proj's bias, and K/V projections when there are
    fewer KV heads than ranks."""
    model = single.engine.runner.model
    args = model.args
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if "norm" in name or name.endswith("o_proj.bias"):
            total += size
        elif "qkv_proj" in name and args.num_kv_heads < 2:
            kv = 2 * args.num_kv_heads * args.head_dim
            total += size * kv // p.shape[0]
    return total


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "gqa"])
def test_tp2_tokens_and_memory(model, gqa_dir):
    single, parallel = _check_model(gqa_dir if model == "gqa" else model)
    try:
        total = weight_bytes(single.engine.runner.model)
        replicated = _replicated_bytes(single)
        per_rank = parallel.engine.runner.rank_weight_bytes
        assert len(per_rank) == 2
        # each rank: half of what is split, all of what is replicated (vocabularies here divide
        # evenly, so there is no padding row)
        assert per_rank == [(total - replicated) // 2 + replicated] * 2, (total, replicated)
        assert max(per_rank) < 0.6 * total
    finally:
        parallel.engine.close()


def test_refused_start_stops_the_workers():
    with pytest.raises(ValueError, match="KV cache has 4 blocks"):
        LLM(model="tiny-llama", tensor_parallel_size=2, **{**ENGINE_ARGS, "num_blocks": 4})
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]


def test_prompt_logprobs_equal_one_device(gqa_dir):
    """Prompt logprobs score rows outside the sampled ones: the workers run the LM head on the
    rows rank 0 broadcasts, chunked prefill included (a 40-token prompt in 16-token chunks)."""
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)
    prompts = [list(range(100, 140)), [1, 5, 9, 33, 2, 7]]
    single = LLM(model=gqa_dir, **ENGINE_ARGS)
    parallel = LLM(model=gqa_dir, tensor_parallel_size=2, **ENGINE_ARGS)
    try:
        want = single.generate(prompts, params, use_tqdm=False)
        got = parallel.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert len(g.prompt_logprobs) == len(w.prompt_logprobs) > 1
            for a, b in zip(w.prompt_logprobs[1:], g.prompt_logprobs[1:]):
                assert (a.token_id, a.top_ids) == (b.token_id, b.top_ids)
                assert abs(a.logprob - b.logprob) < 1e-4
                assert max(abs(x - y) for x, y in zip(a.top_logprobs, b.top_logprobs)) < 1e-4
    finally:
        parallel.engine.close()


@pytest.mark.parametrize("method", ["ngram", "draft_model", "ngram-graphs"])
def test_speculative_decoding_gives_the_one_device_tokens(method):
    """Verification is a step with more logits rows: the workers' LM head takes the same rows.
    The draft model runs whole (TP 1) beside rank 0. ``-graphs``: rank 0 runs its decode and
    verification steps graph-shaped (padded, one attention row per token) and every rank
    follows the header's graph size."""
    spec = {"method": method.removesuffix("-graphs"), "num_speculative_tokens": 3}
    spec.update(
        {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
        if method.startswith("ngram")
        else {"model": "tiny-llama"}  # the target as its own draft: every draft accepted
    )
    prompts = [[1, 5, 9, 33, 2, 7] * 4, list(range(100, 140)), [7, 8, 9] * 10]
    single = LLM(model="tiny-llama", **ENGINE_ARGS)
    parallel = LLM(
        model="tiny-llama", tensor_parallel_size=2, speculative_config=spec, **ENGINE_ARGS
    )
    replayed: list[tuple[int, int]] = []
    if method.endswith("-graphs"):
        _graph_shaped(parallel, replayed)
    try:
        for params in (
            SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True),
        ):
            want = [
                o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)
            ]
            got = [
                o.outputs[0].token_ids for o in parallel.generate(prompts, params, use_tqdm=False)
            ]
            assert got == want
            if params.temperature == 0.0:
                greedy = parallel.engine.scheduler.stats()
        assert greedy.spec_num_draft_tokens > 0
        if method == "draft_model":  # greedy: the target agrees with itself
            assert greedy.spec_num_accepted_tokens >= 0.9 * greedy.spec_num_draft_tokens
        if method.endswith("-graphs"):
            assert any(drafts for _, drafts in replayed), replayed
        parallel.check_integrity()
    finally:
        parallel.engine.close()


def test_killed_rank_fails_cleanly():
    llm = LLM(model="tiny-llama", tensor_parallel_size=2, **ENGINE_ARGS)
    engine = llm.engine
    try:
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        engine.add_request("a", list(range(1, 20)), params)
        engine.step()
        engine.step()
        (pid,) = engine.runner.worker_pids
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(200):
                engine.step()
        assert time.monotonic() - start < 30
    finally:
        engine.close()


def test_rank_dying_at_start_fails_fast():
    """A worker that dies before the group forms fails the start at once, not after the
    rendezvous timeout."""

    def kill_first_worker() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            children = [p for p in multiprocessing.active_children() if p.name == "tp-rank-1"]
            if children:
                os.kill(children[0].pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    threading.Thread(target=kill_first_worker, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited"):
        LLM(model="tiny-llama", tensor_parallel_size=2, **ENGINE_ARGS)
    assert time.monotonic() - start < 30


def test_graph_shaped_overlapped_steps_give_the_serial_tokens():
    """Rank 0 pads its decode steps to a graph's shape and names the graph in the header; the
    workers adopt the padded shape (on a GPU each replays its own capture of that size, the
    all-reduces captured in lockstep; on a CPU both sides run the padded step eagerly). The
    overlap test's workload, overlapped, against one device, serial."""
    from tests.engine.test_overlap import generate

    want, _ = generate(async_scheduling=False)
    got, llm = generate(graphs=True, async_scheduling=True, tensor_parallel_size=2, cpu_threads=1)
    try:
        assert got == want
        assert llm.engine.runner.graphs.replays > 0
    finally:
        llm.engine.close()


def test_overlapped_scheduling_gives_the_serial_tokens(monkeypatch):
    """Step N+1 launched before step N's tokens are read: its ids still on rank 0's device are
    broadcast to the workers on the device group. The overlap test's workload (greedy, seeded,
    n=2, penalties, stop ids, logprobs) with preemption, against one device, serial."""
    from common.step_inputs import InputBuffers
    from tests.engine.test_overlap import generate

    want, _ = generate(async_scheduling=False)
    filled = []
    fill_from = InputBuffers.fill_from

    def counting(self, inputs, previous):
        filled.append(inputs.num_fill)
        return fill_from(self, inputs, previous)

    monkeypatch.setattr(InputBuffers, "fill_from", counting)
    args = dict(num_blocks=40, max_model_len=256, cpu_threads=1)
    got, llm = generate(async_scheduling=True, tensor_parallel_size=2, **args)
    try:
        assert llm.engine.async_scheduling and sum(filled) > 0  # ids came from the device
        assert llm.engine.scheduler.num_preemptions > 0
        assert got == want
    finally:
        llm.engine.close()
