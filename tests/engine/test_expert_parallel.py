"""Expert parallelism (``--enable-expert-parallel``) on CPU, gloo, 2 ranks: each rank holds half
of a MoE model's experts, whole, and the tokens are one device's; a prefill at EP 2 feeds a
decode at EP 1 through the store (the KV is the attention's: the entries do not change)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common import LLM, SamplingParams
from common.config import EngineConfig
from common.engine import EngineCore
from tests.engine.test_moe_models import _hold_out
from tests.kv_store.test_connector import params, prompts, run
from tests.kv_store.test_tensor_parallel_pd import PROMPT_LENS, handoff

ARGS = dict(block_size=8, max_num_batched_tokens=16, num_blocks=64, cpu_threads=1,
            max_model_len=256)  # fmt: skip
PROMPTS = [[1, 5, 9, 33, 2, 7], list(range(10, 52)), [*range(10, 42), 3, 4], [700] * 20]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True)


@pytest.fixture(autouse=True, scope="module")
def _offline_cache(tmp_path_factory):
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))


@pytest.fixture(scope="module")
def per_expert_dir(tmp_path_factory) -> str:
    """A hold-out Qwen3-MoE written per expert, as the Hub holds them (6 experts, top 3, one
    dense layer): the loader reads only this rank's experts' tensors."""
    return str(_hold_out(tmp_path_factory.mktemp("ep"), "qwen3_moe")[1])


def _tokens(llm: LLM) -> list[list[int]]:
    out = []
    for p in (GREEDY, GREEDY, SEEDED):  # the second greedy pass hits the prefix cache
        out += [o.outputs[0].token_ids for o in llm.generate(PROMPTS, p, use_tqdm=False)]
    return out


def _expert_bytes(llm: LLM) -> int:
    model = llm.engine.runner.model
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-qwen3-moe", "hold-out"])
def test_ep2_gives_the_one_device_tokens_with_half_the_experts_per_rank(model, request):
    name = request.getfixturevalue("per_expert_dir") if model == "hold-out" else model
    single = LLM(model=name, **ARGS)
    parallel = LLM(model=name, tensor_parallel_size=2, enable_expert_parallel=True, **ARGS)
    try:
        assert _tokens(parallel) == _tokens(single)
        parallel.check_integrity()
        whole = sum(p.numel() * p.element_size() for p in single.engine.runner.model.parameters())
        for rank_bytes in parallel.engine.runner.rank_weight_bytes:  # experts halved, whole
            assert rank_bytes <= whole - _expert_bytes(single) // 2
        assert _expert_bytes(parallel) == _expert_bytes(single) // 2  # rank 0's share
    finally:
        parallel.engine.close()


def test_moe_at_tp2_without_expert_parallelism_is_refused():
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        LLM(model="tiny-qwen3-moe", tensor_parallel_size=2, **ARGS)


def _engine(model: str, url: str | None, tp: int) -> EngineCore:
    from kv_transfer.connector import create_store_connector

    config = EngineConfig.from_kwargs(
        model=model, kv_store=url, kv_role="both" if url else None, tensor_parallel_size=tp,
        enable_expert_parallel=tp > 1, **ARGS,
    )  # fmt: skip
    return EngineCore(config, create_store_connector if url else None)


def test_prefill_at_ep2_feeds_a_decode_at_ep1_through_the_store(tmp_path: Path):
    url = f"file://{tmp_path}/kv"
    ep2, ep1 = _engine("tiny-qwen3-moe", url, 2), _engine("tiny-qwen3-moe", url, 1)
    colocated = _engine("tiny-qwen3-moe", None, 1)
    try:
        assert ep2.connector[0].fingerprint == ep1.connector[0].fingerprint
        for seed, greedy in enumerate((True, False)):
            ps = prompts(PROMPT_LENS, seed=seed)
            ref = run(colocated, [(f"r{seed}{i}", p, params(12, greedy), None)
                                  for i, p in enumerate(ps)])  # fmt: skip
            tokens, loaded, _ = handoff(ep2, ep1, ps, greedy, f"ep-{seed}-")
            assert tokens == [ref[f"r{seed}{i}"]["tokens"] for i in range(len(ps))]
            assert loaded == list(PROMPT_LENS)  # every prompt token from the store
        for engine in (ep2, ep1):
            engine.check_integrity()
            assert engine.num_free_blocks() == engine.runner.num_blocks
    finally:
        for engine in (ep2, ep1, colocated):
            engine.close()
