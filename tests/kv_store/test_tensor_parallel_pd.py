"""Prefill and decode at different tensor-parallel sizes through one store (CPU, gloo, 2 ranks).

A store entry holds every KV head whatever the TP size, so a TP=2 producer feeds a TP=1
consumer and the reverse, with the tokens of one colocated TP=1 engine (greedy and seeded), and
every prompt token after the first sampled one comes from the store (nothing recomputed).
tiny-llama splits its 2 KV heads one per rank; tiny-qwen2 has one KV head, replicated on both.
"""

from __future__ import annotations

import os

import pytest

from common.config import EngineConfig
from common.engine import EngineCore
from tests.kv_store.test_connector import entry_keys, params, prompts, run

BS = 8
PROMPT_LENS = (5, 8, 45)  # shorter than a block, exactly a block, several blocks + a partial
ARGS = dict(
    block_size=BS,
    max_num_batched_tokens=16,  # the 45-token prompt prefills in chunks, saved chunk by chunk
    num_blocks=64,
    cpu_threads=1,
    max_model_len=256,
)


@pytest.fixture(autouse=True, scope="module")
def _offline_cache(tmp_path_factory):
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))


def make(model: str, url: str | None, tp: int) -> EngineCore:
    from kv_transfer.connector import create_store_connector

    config = EngineConfig.from_kwargs(
        model=model, kv_store=url, kv_role="both" if url else None, tensor_parallel_size=tp, **ARGS
    )
    return EngineCore(config, create_store_connector if url else None)


def handoff(producer: EngineCore, consumer: EngineCore, ps, greedy: bool, tag: str, fault=None):
    """The producer samples the first token and saves the prompt's KV; ``fault(handles)`` may
    break the store; the consumer continues from the handle. Returns the full tokens, how many
    prompt tokens each consumer loaded, and the handles."""
    first = run(producer, [(f"{tag}{i}", p, params(1, greedy), None) for i, p in enumerate(ps)])
    if fault is not None:
        fault([first[f"{tag}{i}"]["handle"] for i in range(len(ps))])
    rest = run(
        consumer,
        [
            (f"{tag}{i}", p, params(12, greedy), first[f"{tag}{i}"]["tokens"], h)
            for i, p in enumerate(ps)
            for h in [first[f"{tag}{i}"]["handle"]]
        ],
    )
    tokens = [first[f"{tag}{i}"]["tokens"] + rest[f"{tag}{i}"]["tokens"] for i in range(len(ps))]
    loaded = [rest[f"{tag}{i}"]["loaded"] for i in range(len(ps))]
    return tokens, loaded, [first[f"{tag}{i}"]["handle"] for i in range(len(ps))]


@pytest.mark.parametrize(("model", "store"), [("tiny-llama", "file"), ("tiny-qwen2", "redis")])
def test_prefill_and_decode_at_different_tp_sizes(model, store, tmp_path, request):
    url = (
        f"file://{tmp_path}/kv" if store == "file" else request.getfixturevalue("redis_server").url
    )
    single, parallel, colocated = make(model, url, 1), make(model, url, 2), make(model, None, 1)
    try:
        fingerprint = single.connector[0].fingerprint
        assert parallel.connector[0].fingerprint == fingerprint  # the TP size is not in it
        directions = [("tp2-to-tp1", parallel, single), ("tp1-to-tp2", single, parallel)]
        for seed, (greedy, (name, producer, consumer)) in enumerate(
            (g, d) for g in (True, False) for d in directions
        ):
            ps = prompts(PROMPT_LENS, seed=seed)  # new prompts: in no engine's prefix cache
            tag = f"{name}-{greedy}-"
            ref = run(
                colocated, [(f"ref{i}", p, params(12, greedy), None) for i, p in enumerate(ps)]
            )
            tokens, loaded, handles = handoff(producer, consumer, ps, greedy, tag)
            assert tokens == [ref[f"ref{i}"]["tokens"] for i in range(len(ps))], tag
            assert loaded == list(PROMPT_LENS), tag  # every prompt token from the store
            assert {h.fingerprint for h in handles} == {fingerprint}
        # a missing entry under TP = 2: the blocks from it on are recomputed, same tokens
        ps = prompts(PROMPT_LENS, seed=10)
        ref = run(colocated, [(f"m{i}", p, params(12, True), None) for i, p in enumerate(ps)])

        def drop_third_block(handles) -> None:
            assert single.connector[0].store.delete_many([entry_keys(handles[2])[2]]) == 1

        tokens, loaded, _ = handoff(single, parallel, ps, True, "missing-", drop_third_block)
        assert tokens == [ref[f"m{i}"]["tokens"] for i in range(len(ps))]
        assert loaded == [5, 8, 2 * BS]  # the long prompt: only the two blocks before the hole
        for engine in (single, parallel):
            engine.check_integrity()
            assert engine.num_free_blocks() == engine.runner.num_blocks
        worker = parallel.runner.connector
        assert worker.num_loaded_blocks > 0 and worker.num_saved_blocks > 0
    finally:
        for engine in (single, parallel, colocated):
            engine.close()
