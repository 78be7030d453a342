"""The engine's LoRA path through ``kernels/lora.py`` (the CUDA path, interpreted here) gives
the tokens of the CPU's grouped GEMMs, in a step mixing two adapters and the base model."""

from __future__ import annotations

import pytest

from common import LLM, SamplingParams
from common.models.names import resolve_model_path
from tests.engine.hf_reference import random_prompts
from tests.lora.adapters import base_and_adapters, write_test_adapters


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return write_test_adapters(resolve_model_path("tiny-llama"), tmp_path_factory.mktemp("lora"))


def test_kernel_path_equals_the_cpu_path(dirs):
    prompts = random_prompts(1000, 3, (18, 24), seed=21)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = []
    for kernels in (False, True):
        with LLM("tiny-llama", enable_lora=True, max_loras=2, num_blocks=256) as llm:
            manager = llm.engine.runner.lora
            assert manager is not None
            manager.kernels = kernels
            loras = base_and_adapters(llm, dirs)
            outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
            tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]


def test_graph_rows_refilled_per_replay_equal_eager(dirs):
    """What a captured decode graph does under LoRA, interpreted on the CPU: the LoRA kernels
    read fixed buffers (``GraphLoraBatch``) that each replay refills with the step's rows,
    padded rows and padding tiles doing nothing; the tokens equal the eager CPU path's."""
    from common.cuda_graphs import DecodeGraphs

    prompts = random_prompts(1000, 3, (10, 20), seed=22)
    greedy = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    args = dict(enable_lora=True, max_loras=2, num_blocks=128, max_model_len=256)
    tokens, replayed = [], []
    for shaped in (False, True):
        with LLM("tiny-llama", **args) as llm:
            runner = llm.engine.runner
            if shaped:
                graphs = DecodeGraphs(runner.model, runner.inputs, runner.block_size, [1, 4],
                                      max_seq_len=128, capture=False, lora=runner.lora)  # fmt: skip
                graphs.capture_all(runner.kv_layers)
                rows = runner.lora.graph_batch(graphs.max_size)
                assert rows.tiles.shape[0] == 2  # 4 rows over 2 slots: at most 2 tiles

                def replay(
                    size, inputs, lora_slots=None, graphs=graphs, rows=rows, kv=runner.kv_layers
                ):
                    replayed.append((size, lora_slots))
                    rows.refill([] if lora_slots is None else lora_slots)
                    inputs.meta.lora = rows
                    return graphs.model(inputs.input_ids, inputs.positions, kv, inputs.meta)

                graphs.replay = replay
                runner.graphs = graphs
            loras = base_and_adapters(llm, dirs)
            outs = llm.generate(prompts, greedy, use_tqdm=False, lora_request=loras)
            tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]
    assert replayed and all(size == 4 for size, _ in replayed)
    assert any(slots is not None and -1 in slots for _, slots in replayed)  # base rows mixed in
