"""The host KV tier (``--kv-offload-gb``, ``common/host_kv_tier.py``): blocks evicted from the
device's prefix cache are kept in host memory and come back as prefix hits, device first, then
the host tier, then the store; tokens never change."""

from __future__ import annotations

import functools
import random

import pytest

from common import LLM, SamplingParams
from common.config import EngineConfig
from common.engine import EngineCore
from common.host_kv_tier import HostCopies, HostTierIndex
from common.kv_cache_manager import KVCacheManager
from common.request import Request
from kv_transfer.connector import create_store_connector

BS = 8


def _hash(i: int) -> bytes:
    return i.to_bytes(32, "little")


# -- the index ---------------------------------------------------------------------------------
def test_the_index_keeps_the_most_recent_blocks_and_never_reuses_a_pinned_slot():
    index = HostTierIndex(2)
    index.offload(10, _hash(1))
    index.offload(11, _hash(2))
    index.offload(12, _hash(2))  # the same KV again: no copy
    assert index.take_copies() == HostCopies([(10, 0), (11, 1)], [])
    assert index.lookup([_hash(1), _hash(2), _hash(3)]) == [0, 1]
    index.pin([_hash(1)])  # a hit this step: most recent, and its slot kept
    index.offload(13, _hash(3))  # takes hash 2's slot, the least recent unpinned one
    index.load([_hash(1)], [20])
    index.offload(14, _hash(4))  # takes hash 3's slot: only the pinned one is safe
    assert index.take_copies() == HostCopies([(13, 1), (14, 1)], [(0, 20)])
    assert index.lookup([_hash(2)]) == index.lookup([_hash(3)]) == []
    assert index.lookup([_hash(4)]) == [1]
    index.offload(15, _hash(5))  # the pin ended with the step: hash 1 is the least recent
    assert index.take_copies() == HostCopies([(15, 0)], [])
    assert tuple(index.stats()) == (5, 1, 0)
    one = HostTierIndex(1)
    one.offload(1, _hash(1))
    one.take_copies()
    one.pin([_hash(1)])
    one.offload(2, _hash(2))  # the only slot is pinned: dropped
    assert one.take_copies() is None and tuple(one.stats()) == (1, 0, 1)
    index.clear()
    assert len(index) == 0 and index.take_copies() is None


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), eos_token_id=None, block_size=BS,
                   seed=0, max_tokens=4)  # fmt: skip


def test_the_manager_offloads_on_eviction_and_hits_device_then_host():
    kv = KVCacheManager(4, BS, host_tier=HostTierIndex(8))
    a = _request("a", list(range(3, 3 + 4 * BS)))  # 4 blocks, 3 of them hittable
    assert kv.allocate_slots(a, a.num_tokens) == [0, 1, 2, 3]
    kv.cache_blocks(a, a.num_tokens)
    kv.free("a")  # freed last block first: 3, 2, 1, 0 in the queue
    b = _request("b", list(range(500, 500 + 2 * BS)))
    assert kv.allocate_slots(b, b.num_tokens) == [3, 2]  # evicts a's blocks 3 and 2
    assert kv.take_host_copies() == HostCopies([(3, 0), (2, 1)], [])
    kv.free("b")
    a2 = _request("a2", a.prompt_token_ids)
    hit = kv.find_computed_blocks(a2)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]  # the device first
    assert list(hit.host_hashes) == [a.block_hashes[2]] and hit.num_tokens == 3 * BS
    new = kv.allocate_slots(a2, a2.num_tokens - hit.num_tokens, hit)
    copies = kv.take_host_copies()
    assert copies is not None and copies.loads == [(1, new[0])]  # block 2's slot, copied in
    assert kv.pool.get_cached_block(a.block_hashes[2]).block_id == new[0]
    kv.reset_prefix_cache()  # a reset drops the host tier too
    assert kv.host_tier.lookup([a.block_hashes[3]]) == []


# -- whole engine ------------------------------------------------------------------------------
PROMPTS = [[random.Random(i).randrange(3, 1000) for _ in range(40 + 9 * i)] for i in range(6)]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _rounds(llm: LLM) -> list[list[int]]:
    """Every prompt three times, one at a time: a device too small for all of them evicts the
    early prompts' prefixes before they come back."""
    tokens = []
    for _ in range(3):
        for i, prompt in enumerate(PROMPTS):
            out = llm.generate([prompt], _params(i), use_tqdm=False)[0]
            tokens.append(out.outputs[0].token_ids)
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks
    return tokens


@pytest.fixture(scope="module")
def reference():
    llm = LLM(model="tiny-llama", block_size=BS, num_blocks=256, max_model_len=128)
    return _rounds(llm), llm.engine.scheduler.num_scheduled_tokens


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_hits_from_the_host_tier_give_the_same_tokens_with_less_compute(reference, overlap):
    want, _ = reference
    small = dict(model="tiny-llama", block_size=BS, num_blocks=24, max_model_len=128)
    plain = LLM(**small, async_scheduling=overlap)
    assert _rounds(plain) == want
    tiered = LLM(**small, async_scheduling=overlap, kv_offload_gb=0.01)
    assert _rounds(tiered) == want
    stats = tiered.engine.stats()
    assert stats.host_tier_offloaded_blocks > 0 and stats.host_tier_loaded_blocks > 10
    computed = tiered.engine.scheduler.num_scheduled_tokens
    without = plain.engine.scheduler.num_scheduled_tokens
    assert computed <= without - BS * stats.host_tier_loaded_blocks, (computed, without)


def test_preemption_with_a_host_tier_gives_the_same_tokens(reference):
    """All prompts at once in a cache that cannot hold them: preempted requests' cached blocks
    are evicted to the host tier and hit again when they resume."""
    llm = LLM(
        model="tiny-llama", block_size=BS, num_blocks=20, max_model_len=128, kv_offload_gb=0.01
    )
    ref = LLM(model="tiny-llama", block_size=BS, num_blocks=256, max_model_len=128)
    params = [_params(i) for i in range(len(PROMPTS))]
    want = [o.outputs[0].token_ids for o in ref.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().host_tier_loaded_blocks > 0
    llm.check_integrity()


SWAP_PROMPTS = [[random.Random(i).randrange(3, 1000) for _ in range(20 + 7 * i)] for i in range(8)]
SWAP_PARAMS = [
    SamplingParams(temperature=0.8 if i % 2 else 0.0, seed=i, max_tokens=40, ignore_eos=True)
    for i in range(len(SWAP_PROMPTS))
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}


def _swap_run(num_blocks: int, **args) -> tuple[list[list[int]], LLM]:
    llm = LLM(model="tiny-llama", block_size=BS, max_model_len=128, num_blocks=num_blocks, **args)
    outs = llm.generate(SWAP_PROMPTS, SWAP_PARAMS, use_tqdm=False)
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == num_blocks
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize(
    "args",
    [{"async_scheduling": False}, {"async_scheduling": True}, {"speculative_config": NGRAM}],
    ids=["serial", "overlapped", "speculative"],
)
def test_preempted_requests_swap_through_the_host_tier_and_recompute_nothing(args):
    """A cache of 30 blocks for 8 requests that grow to ~10 each: requests are preempted, and
    with a host tier each resumes where it stopped: its cached blocks come back by hash, its
    partial last block (and any full block whose hash was not known yet) under its own keys.
    Greedy and seeded tokens equal the unpreempted run's, and not one token is computed twice;
    without the tier the preempted requests recompute."""
    want, unpreempted = _swap_run(256, **args)
    got, swapped = _swap_run(30, kv_offload_gb=0.01, **args)
    assert got == want
    assert swapped.engine.scheduler.num_preemptions > 0
    computed = swapped.engine.scheduler.num_scheduled_tokens
    assert computed == unpreempted.engine.scheduler.num_scheduled_tokens
    plain, recomputed = _swap_run(30, **args)
    assert plain == want
    assert recomputed.engine.scheduler.num_scheduled_tokens > computed


def test_a_tier_too_small_for_the_swap_falls_back_to_recompute():
    want, unpreempted = _swap_run(256)
    got, llm = _swap_run(30, kv_offload_gb=0.0001)  # 6 slots of 16 KiB
    assert got == want
    stats = llm.engine.stats()
    assert llm.engine.scheduler.num_preemptions > 0 and stats.host_tier_loaded_blocks > 0
    assert (
        llm.engine.scheduler.num_scheduled_tokens
        > unpreempted.engine.scheduler.num_scheduled_tokens
    )


def test_the_host_tier_is_asked_before_the_store(tmp_path):
    """A consumer that loaded a prompt from the store, evicted it and sees it again loads it
    from its host tier: the store is not read a second time, and the tokens are the same."""
    from tests.kv_store.test_connector import run

    url = f"file://{tmp_path}/kv"
    args = dict(model="tiny-llama", block_size=BS, max_model_len=128, kv_store=url)
    factory = functools.partial(create_store_connector)
    producer = EngineCore(EngineConfig.from_kwargs(**args, num_blocks=256, kv_role="producer"),
                          factory)  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    first = run(producer, [(str(i), p, greedy, None) for i, p in enumerate(PROMPTS)])
    producer.close()
    consumer = EngineCore(
        EngineConfig.from_kwargs(**args, num_blocks=24, kv_role="consumer", kv_offload_gb=0.01),
        factory,
    )
    decode = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    loads = []
    results = []
    for round_ in range(2):
        for i, prompt in enumerate(PROMPTS):
            rid = f"{round_}-{i}"
            out = run(consumer, [(rid, prompt, decode, first[str(i)]["tokens"])])[rid]
            loads.append(out["loaded"])
            results.append(out["tokens"])
    consumer.close()
    n = len(PROMPTS)
    assert results[:n] == results[n:]
    assert all(loads[:n])  # the first round came from the store
    stats = consumer.stats()
    assert stats.host_tier_loaded_blocks > 0
    assert sum(loads[n:]) < sum(loads[:n]) - BS * (stats.host_tier_loaded_blocks // 2)


def test_a_host_tier_needs_prefix_caching_and_one_device():
    with pytest.raises(ValueError, match="prefix caching"):
        EngineConfig.from_kwargs(model="tiny-llama", kv_offload_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(model="tiny-llama", kv_offload_gb=1, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLM(model="tiny-llama", kv_offload_gb=1e-9)
