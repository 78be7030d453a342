"""Balancing policies: prefix affinity vs load for prefill, load for decode."""

from __future__ import annotations

from pdserve_proto.nodes import NodeLoad

from common.block_hash import hash_blocks
from router.balancer import (
    CacheAwarePrefill,
    LeastLoadDecode,
    PromptInfo,
    RecentBlocks,
    RoundRobin,
)
from router.registry import Instance, Role

BLOCK = 16


def prompt(token_ids: list[int]) -> PromptInfo:
    return PromptInfo(len(token_ids), hash_blocks(token_ids, BLOCK), BLOCK)


def instances(n: int, role: Role = Role.PREFILL) -> list[Instance]:
    return [Instance(f"i{k}", role, f"h:{k}") for k in range(n)]


def test_recent_blocks_prefix_match_and_lru() -> None:
    recent = RecentBlocks(capacity=3)
    hashes = hash_blocks(list(range(64)), BLOCK)  # 4 chained blocks
    recent.add(hashes[:2])
    assert recent.matched_blocks(hashes) == 2
    assert recent.matched_blocks(hashes[1:]) == 1  # leading run only
    recent.add(hashes[2:4])  # capacity 3: hashes[0] is the least recently used
    assert len(recent) == 3 and recent.matched_blocks(hashes) == 0


def test_cache_aware_follows_the_prefix_when_idle() -> None:
    policy = CacheAwarePrefill()
    pool = instances(3)
    shared = list(range(100, 164))  # 4 blocks
    first = policy.choose(pool, prompt([*shared, 1, 2, 3]))
    for tail in ([4, 5], [6], list(range(200, 240))):
        assert policy.choose(pool, prompt(shared + tail)) is first


def test_load_outweighs_affinity_when_the_owner_is_hot() -> None:
    policy = CacheAwarePrefill(request_cost_tokens=64)
    pool = instances(2)
    shared = list(range(100, 356))  # 16 blocks
    owner = policy.choose(pool, prompt(shared))
    other = next(i for i in pool if i is not owner)
    # 256 cached tokens are worth more than one small request queued on the owner...
    owner.inflight, owner.inflight_tokens = 1, 10
    assert policy.choose(pool, prompt(shared + [8] * 200)) is owner
    # ...and less than 5000 queued prompt tokens there.
    owner.load = NodeLoad(num_waiting=20, queued_prompt_tokens=5000)
    assert policy.choose(pool, prompt([*shared, 7])) is other
    # The dispatch taught the router that `other` now holds the prefix too.
    assert policy.recent(other).matched_blocks(prompt(shared).block_hashes) == 16


def test_inflight_counts_between_reports_and_ties_rotate() -> None:
    policy = CacheAwarePrefill(affinity=False)
    pool = instances(2)
    picks = [policy.choose(pool, prompt([1] * 5)).instance_id for _ in range(4)]
    assert sorted(picks) == ["i0", "i0", "i1", "i1"]
    pool[0].inflight, pool[0].inflight_tokens = 3, 300
    assert policy.choose(pool, prompt([1] * 5)) is pool[1]


def test_decode_least_load() -> None:
    policy = LeastLoadDecode()
    pool = instances(3, Role.DECODE)
    pool[0].load = NodeLoad(kv_usage=0.9, num_running=2, max_num_seqs=8)
    pool[1].load = NodeLoad(kv_usage=0.1, num_running=6, max_num_seqs=8)
    pool[2].load = NodeLoad(kv_usage=0.2, num_running=1, max_num_seqs=8)
    assert policy.choose(pool, prompt([1])) is pool[2]
    pool[2].inflight = 8  # the router's own streams there, newer than the report
    assert policy.choose(pool, prompt([1])) is pool[1]


def test_round_robin_cycles() -> None:
    policy = RoundRobin()
    pool = instances(3)
    assert [policy.choose(pool, prompt([1])).instance_id for _ in range(6)] == [
        "i0", "i1", "i2", "i0", "i1", "i2",
    ]  # fmt: skip
