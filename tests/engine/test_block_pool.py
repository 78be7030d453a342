"""Block pool and KV cache manager: exact block ids, ref counts and eviction order (no tensors)."""

import pytest

from common.block_hash import hash_blocks, hash_partial_block, root_hash
from common.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from common.kv_cache_manager import KVCacheManager
from common.request import Request
from common.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=8),
        eos_token_id=None,
        block_size=BS,
        seed=0,
        max_tokens=8,
        cache_salt=salt,
    )


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def test_free_queue_is_o1_linked_list():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert q.popleft().block_id == 0
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 0]
    assert q.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])


def test_hashes_are_chained_and_salted():
    a = hash_blocks(list(range(8)), BS)
    b = hash_blocks([0, 1, 2, 3, 9, 9, 9, 9], BS)
    assert a[0] == b[0] and a[1] != b[1]
    # same second block, different first block: different hash (it covers the prefix)
    c = hash_blocks([7, 7, 7, 7, 4, 5, 6, 7], BS)
    assert c[1] != a[1]
    assert hash_blocks(list(range(8)), BS, salt="x") != a
    assert root_hash() != root_hash("x")
    assert hash_partial_block(a[0], [4, 5]) != hash_partial_block(a[0], [4, 5, 6])
    assert len(a[0]) == 32


def test_allocate_exact_block_ids_and_free_order():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    r = make_request("a", list(range(10)))  # 10 tokens → 3 blocks
    assert kv.allocate_slots(r, 10) == [0, 1, 2]
    assert kv.get_block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 10
    kv.cache_blocks(r, 10)  # two full blocks cached
    assert kv.allocate_slots(r, 2) == []  # 12 tokens still fit in 3 blocks
    assert kv.allocate_slots(r, 3) == [3]  # 13 tokens → 4 blocks
    kv.free("a")
    # freed tail-first: the end of the sequence is evicted before its prefix
    assert free_ids(kv.pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    assert kv.pool.blocks[0].block_hash is not None
    kv.check_integrity()


def test_prefix_hit_reuses_blocks_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(10)))
    kv.allocate_slots(a, 10)
    kv.cache_blocks(a, 10)
    b = make_request("b", [*range(8), 42, 43, 44])
    hit = kv.find_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1] and hit.num_tokens == 8
    kv.record_lookup(b, hit)
    assert kv.allocate_slots(b, 3, hit) == [3]
    assert [blk.ref_cnt for blk in kv.pool.blocks[:4]] == [2, 2, 1, 1]
    assert kv.stats.hits == 8 and kv.stats.queries == 11
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_full_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(8)))
    kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    b = make_request("b", list(range(8)))
    assert kv.find_computed_blocks(b).num_tokens == 4  # the last block is recomputed


def test_hit_on_free_cached_block_revives_it_and_eviction_is_lru():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    kv.free("a")
    assert free_ids(kv.pool) == [3, 2, 1, 0]
    b = make_request("b", [*range(8), 5])
    hit = kv.find_computed_blocks(b)
    assert [blk.block_id for blk in hit.blocks] == [0, 1]
    assert kv.allocate_slots(b, 1, hit) == [3]  # head of the queue: block 3 (never cached)
    assert free_ids(kv.pool) == [2]
    c = make_request("c", [50, 51, 52, 53, 54])
    assert kv.allocate_slots(c, 5) is None  # needs 2, one free: nothing changes
    assert free_ids(kv.pool) == [2] and "c" not in kv.req_to_blocks
    kv.free("b")
    kv.check_integrity()


def test_eviction_drops_cache_entry():
    kv = KVCacheManager(num_blocks=2, block_size=BS)
    a = make_request("a", list(range(5)))
    kv.allocate_slots(a, 5)
    kv.cache_blocks(a, 5)
    kv.free("a")  # free queue: [1, 0]; block 0 cached
    c = make_request("c", [9] * 8)
    kv.allocate_slots(c, 8)  # takes 1 then 0: block 0's cache entry is evicted
    assert kv.pool.num_evictions == 1
    assert kv.find_computed_blocks(make_request("d", list(range(5)))).num_tokens == 0
    kv.free("c")
    kv.check_integrity()


def test_check_integrity_catches_leaks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.allocate_slots(make_request("a", [1, 2]), 2)
    kv.pool.blocks[0].ref_cnt += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()


def test_prompt_block_hashes_match_the_requests():
    from common.block_hash import prompt_block_hashes
    from kv_transfer.scheduler import prompt_hashes

    for n in (3, 8, 13):
        tokens = list(range(100, 100 + n))
        r = make_request("p", tokens)
        assert prompt_block_hashes(tokens, BS) == prompt_hashes(r)
        assert len(prompt_block_hashes(tokens, BS)) == -(-n // BS)
