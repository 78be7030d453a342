"""The offline engine with the Triton backend forced gives the PyTorch backend's greedy tokens."""

import random

import pytest

from common import LLM, SamplingParams


def test_triton_backend_matches_torch_backend_end_to_end():
    rng = random.Random(3)
    # ragged prompts: one token, a block boundary, several blocks; chunked prefill + decodes mix
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (1, 16, 17, 45, 70)]
    # top-2 logprobs: where the tokens differ, the message says whether it was a near-tie
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    args = dict(model="tiny-llama", max_num_batched_tokens=32, num_blocks=64, max_model_len=512)
    torch_llm = LLM(attention_backend="torch", **args)
    triton_llm = LLM(attention_backend="triton", **args)
    assert triton_llm.engine.runner.backend.name == "triton"
    want = [o.outputs[0] for o in torch_llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    assert [o.token_ids for o in got] == [o.token_ids for o in want], _first_difference(got, want)
    want = [o.token_ids for o in want]
    # a prefix-cache hit on the second pass goes through the chunked-prefill kernel's cache path
    again = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, params, use_tqdm=False)]
    assert again == want
    triton_llm.check_integrity()


def _first_difference(got, want) -> str:
    """The first token the backends disagree on, with each one's top-2 there."""
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True)):
            if x != y:
                top = [
                    dict(zip(o.logprobs[j].top_ids, o.logprobs[j].top_logprobs, strict=True))
                    for o in (a, b)
                ]
                return f"prompt {i}, token {j}: triton top-2 {top[0]}, torch top-2 {top[1]}"
    return "no token differs"


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
def test_graph_shaped_decode_with_the_triton_kernels(model):
    """What a CUDA graph replays, run on CPU under the interpreter: Triton decode attention over
    the fixed-address input buffers, the batch padded to a captured size (rows of seq len 0,
    slot -1), the block table at the graph's fixed width, overlapped with the next schedule.
    tiny-qwen3: the q/k norms (Triton rms_norm over head rows) inside the graph, head_dim 64."""
    from common.cuda_graphs import DecodeGraphs

    rng = random.Random(4)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (3, 20, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    args = dict(model=model, max_num_batched_tokens=64, num_blocks=64, max_model_len=256)
    eager = LLM(attention_backend="triton", **args)
    want = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    shaped = LLM(attention_backend="triton", async_scheduling=True, **args)
    runner = shaped.engine.runner
    runner.graphs = DecodeGraphs(
        runner.model, runner.inputs, runner.block_size, [1, 4], max_seq_len=128, capture=False
    )
    runner.graphs.capture_all(runner.kv_layers)
    replayed = []
    real_replay = runner.graphs.replay
    runner.graphs.replay = lambda size, *rest: replayed.append(size) or real_replay(size, *rest)
    got = [o.outputs[0].token_ids for o in shaped.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert replayed and set(replayed) == {4}  # 3 decoding sequences padded to 4 rows
    shaped.check_integrity()
