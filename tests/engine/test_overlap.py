"""The overlapped loop and graph-shaped decode steps give the serial loop's tokens.

Overlapped (``async_scheduling``): step N+1 is scheduled and launched before step N's tokens are
read, so every rule of the scheduler's "scheduling ahead" NOTE is exercised here on CPU: tokens
still on the device feed the next step, stops drop one row, ``max_tokens`` is not overrun,
penalties wait for their tokens, preemption with a token in flight; ``n = 2`` requests run as
two samples sharing their prompt through the prefix cache.

Graph-shaped: the CUDA-graph path (padded batch, fixed-address buffers, fixed block-table width)
run eagerly on CPU (``DecodeGraphs(capture=False)``); on a GPU the same inputs are replayed.
"""

from __future__ import annotations

import random

import pytest

from common import LLM, SamplingParams
from common.config import RunnerConfig
from common.cuda_graphs import DecodeGraphs, capture_sizes
from common.request import Request
from common.step_outputs import ScheduledRequest

N = 20


def workload(seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 120))] for _ in range(N)]
    lengths = [rng.randint(1, 24) for _ in range(N)]
    params = [
        SamplingParams(
            temperature=0.0 if i % 3 == 0 else 0.8,
            seed=i,
            max_tokens=lengths[i],
            ignore_eos=True,
            min_tokens=2 if i % 5 == 0 and lengths[i] >= 2 else 0,
            logprobs=2 if i % 4 == 0 else None,
            n=2 if i % 7 == 0 else 1,
            repetition_penalty=1.3 if i % 6 == 0 else 1.0,
            stop_token_ids=[5, 6, 7, 8, 9] if i % 8 == 0 else [],
        )
        for i in range(N)
    ]
    return prompts, params


def generate(graphs: bool = False, graph_len: int | None = 256, **engine_args) -> tuple[list, LLM]:
    """``graph_len``: the context graph-shaped steps cover (their tables' width); None:
    ``max_model_len``, as ``DecodeGraphs.for_config`` chooses by default."""
    llm = LLM(model="tiny-llama", max_num_batched_tokens=64, **engine_args)
    if graphs:
        runner = llm.engine.runner
        runner.graphs = DecodeGraphs(
            runner.model,
            runner.inputs,
            runner.block_size,
            [1, 2, 4, 8, 16],
            max_seq_len=graph_len or runner.max_model_len,
            capture=False,
        )
        runner.graphs.capture_all(runner.kv_layers)
    prompts, params = workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks
    tokens = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    return tokens, llm


@pytest.fixture(scope="module")
def serial():
    return generate(async_scheduling=False)[0]


@pytest.mark.parametrize(
    "args",
    [
        {},
        {"num_blocks": 40, "max_model_len": 256},  # preemption, some with a token in flight
        {"max_num_seqs": 3},
    ],
    ids=["plain", "preemption", "few-seqs"],
)
def test_overlapped_equals_serial(serial, args):
    tokens, llm = generate(async_scheduling=True, **args)
    assert tokens == serial
    if "num_blocks" in args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_overlap_launches_before_reading(monkeypatch):
    """Step N+1 is executed before step N's tokens are read (the point of the overlap)."""
    llm = LLM(model="tiny-llama", async_scheduling=True)
    runner, events = llm.engine.runner, []
    real_execute = runner.execute

    def execute(out):
        result = real_execute(out)
        events.append(("execute", id(result)))
        if result is not None:
            real_tokens = result.tokens
            result.tokens = lambda: events.append(("read", id(result))) or real_tokens()
        return result

    monkeypatch.setattr(runner, "execute", execute)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    first_read = next(i for i, e in enumerate(events) if e[0] == "read")
    assert events[first_read - 1][0] == "execute" and events[first_read][1] != events[-1][1]
    assert [e[0] for e in events[:3]] == ["execute", "execute", "read"]


def test_overlap_does_not_run_past_max_tokens():
    llm = LLM(model="tiny-llama", async_scheduling=True)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate([[3, 4, 5]], params, use_tqdm=False)
    # 1 prompt step + 4 decode steps: a 6th (for nobody) was never scheduled
    assert llm.engine.scheduler.num_scheduled_tokens == 3 + 4


def test_graph_shaped_steps_equal_eager(serial):
    tokens, _ = generate(graphs=True, async_scheduling=False)
    assert tokens == serial


def test_graph_shaped_and_overlapped(serial):
    tokens, _ = generate(graphs=True, async_scheduling=True)
    assert tokens == serial


def test_graph_shaped_steps_over_max_model_len_wide_tables_equal_eager(serial):
    tokens, llm = generate(graphs=True, graph_len=None, async_scheduling=True)
    assert llm.engine.runner.graphs.row_stride == llm.engine.runner.inputs.limits.max_blocks_per_seq
    assert tokens == serial


def _decode_rows(context: int, n: int = 3) -> list[ScheduledRequest]:
    rows = []
    for i in range(n):
        r = Request(str(i), [1] * context, SamplingParams(), eos_token_id=None, block_size=16,
                    seed=0, max_tokens=4)  # fmt: skip
        rows.append(ScheduledRequest(r, 1, True, list(range(context // 16 + 1)), context))
    return rows


def test_graphs_cover_max_model_len_unless_asked_for_less():
    """The capture plan: tables as wide as ``max_model_len`` (a 100k-token decode replays a
    graph), or ``max_seq_len_to_capture``'s when given (it runs eagerly)."""
    wide = DecodeGraphs.for_config(None, None, RunnerConfig(max_num_seqs=8), 16, 131072, False)
    asked = RunnerConfig(max_num_seqs=8, max_seq_len_to_capture=8192)
    narrow = DecodeGraphs.for_config(None, None, asked, 16, 131072, False)
    for graphs in (wide, narrow):
        graphs.capture_all([])  # on CPU: only remembers the cache
    assert (wide.row_stride, narrow.row_stride) == (8192, 512)
    assert wide.size_for(_decode_rows(100_000)) == 4
    assert narrow.size_for(_decode_rows(100_000)) is None
    assert narrow.size_for(_decode_rows(8000)) == 4
    assert wide.size_for(_decode_rows(131071)) == 4  # the last position of max_model_len
    assert wide.size_for(_decode_rows(131072)) is None  # past the tables


def test_graph_sizes_and_fallbacks():
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(64, (4, 1, 100)) == [1, 4]
    llm = LLM(model="tiny-llama")
    runner = llm.engine.runner
    graphs = DecodeGraphs(
        runner.model, runner.inputs, runner.block_size, [1, 2, 4], max_seq_len=64, capture=False
    )
    graphs.capture_all(runner.kv_layers)
    replayed = []
    real_replay = graphs.replay
    graphs.replay = lambda size, *rest: replayed.append(size) or real_replay(size, *rest)
    runner.graphs = graphs
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # 3 sequences decode in 4-row graphs until the longest passes 64 tokens of context, then
    # eagerly; the prompt steps are eager too
    out = llm.generate([[3] * 10, [4] * 20, [5] * 30], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 40 for o in out)
    assert set(replayed) == {4}
    assert len(replayed) == 64 - 30  # decode steps while every context fits 64 tokens
