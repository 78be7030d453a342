"""The KV cache manager: the only owner of block tables.

It turns "request R needs N more token slots" into physical block ids and finds prefix-cache
hits by chained block hashes; a hit shares full blocks (ref counts), which are never written
again, so no block is ever copied. Plain ints, no tensors.

A request's block ids only grow at their end, except when the table is made (first allocation,
again after a free) or trimmed: each of those gives it a new *version*, a number this manager
never hands out twice. Whoever mirrors a table (the runner's block-table rows,
``common/block_table.py``) copies only the ids past what it holds while the version stays.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

from common.block_hash import BlockHash
from common.block_pool import BlockPool, KVCacheBlock, PrefixCacheStats
from common.host_kv_tier import HostCopies, HostTierIndex, SwappedKV, swap_key
from common.request import Request


class ComputedBlocks(NamedTuple):
    """A prefix-cache hit: blocks whose KV is already in the cache, then the hashes of the
    blocks after them that the host tier holds (copied in by the step), and the tokens they all
    cover."""

    blocks: list[KVCacheBlock]
    num_tokens: int
    host_hashes: Sequence[BlockHash] = ()
    swapped: Sequence[bytes] = ()  # then the request's own swapped blocks (never cached)


NO_HIT = ComputedBlocks([], 0)


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostTierIndex | None = None,
    ):
        """``host_tier``: where evicted cached blocks go and hits may come from after the
        device's (``common/host_kv_tier.py``); needs prefix caching."""
        self.block_size = block_size
        self.host_tier = host_tier if enable_prefix_caching else None
        on_evict = self.host_tier.offload if self.host_tier is not None else None
        self.pool = BlockPool(num_blocks, enable_prefix_caching, on_evict)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same tables as plain ids, kept in step so a step never rebuilds them per block.
        self.req_to_ids: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # request id → leading blocks registered in cache
        self.req_to_version: dict[str, int] = {}  # request id → its table's version (above)
        self._versions = itertools.count()
        self.stats = PrefixCacheStats()

    # -- queries (no side effects) ------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (live: read it, do not keep it across allocations)."""
        return self.req_to_ids.get(request_id, [])

    def table_version(self, request_id: str) -> int:
        """The version of the request's block table: while it stays, the ids only grew at the
        end (see the module docstring). The request must hold a table."""
        return self.req_to_version[request_id]

    def find_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of ``request`` in full blocks. Does not modify the cache.

        At least one token is always left to compute: its logits give the next token. A request
        asking for prompt logprobs gets no hit: they need every prompt position computed.
        """
        if not self.pool.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        tier = self.host_tier
        if tier is None or (len(hits) == max_blocks and request.swapped is None):
            return ComputedBlocks(hits, len(hits) * self.block_size)
        rest = request.block_hashes[len(hits) : max_blocks]
        host = rest[: len(tier.lookup(rest))]
        found = len(hits) + len(host)
        swap = request.swapped
        if swap is None or not swap.first_block <= found < swap.first_block + len(swap.keys):
            return ComputedBlocks(hits, found * self.block_size, host)
        keys = swap.keys[found - swap.first_block :]
        keys = keys[: len(tier.lookup(keys))]
        end = found + len(keys)
        tokens = min(end * self.block_size, swap.num_tokens, request.num_tokens - 1)
        return (
            ComputedBlocks(hits, tokens, host, keys)
            if keys
            else ComputedBlocks(hits, found * self.block_size, host)
        )

    def record_lookup(self, request: Request, hit: ComputedBlocks) -> None:
        self.stats.queries += request.num_tokens
        self.stats.hits += hit.num_tokens

    # -- allocation --------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks = NO_HIT,
        num_external_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` after the request's computed tokens.

        ``computed`` are prefix-cache hits to adopt (only on a request's first allocation) and
        ``num_external_tokens`` tokens whose KV a connector will load. Returns the ids of the
        newly allocated blocks, or ``None`` (and changes nothing) when too few blocks are free.
        """
        held = self.req_to_blocks.get(request.request_id)
        # a running request's step inside the blocks it holds (most decode steps): nothing to
        # take, count or touch
        if (
            held is not None
            and computed is NO_HIT
            and not num_external_tokens
            and request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size
        ):
            return []
        if held is None:
            held = self.req_to_blocks[request.request_id] = []
        num_total = (
            request.num_computed_tokens + computed.num_tokens + num_external_tokens + num_new_tokens
        )
        num_needed = max(0, cdiv(num_total, self.block_size) - len(held) - len(computed.blocks))
        revived = sum(1 for b in computed.blocks if b.ref_cnt == 0)  # free now, taken by touch
        if num_needed + revived > self.pool.num_free_blocks:
            if not held:
                del self.req_to_blocks[request.request_id]
            return None
        ids = self.req_to_ids.get(request.request_id)
        if ids is None:
            ids = self.req_to_ids[request.request_id] = []
            self.req_to_version[request.request_id] = next(self._versions)
        self.pool.touch(computed.blocks)
        held.extend(computed.blocks)
        ids.extend(b.block_id for b in computed.blocks)
        tier, host, swapped = self.host_tier, computed.host_hashes, computed.swapped
        if tier is not None:  # before the allocation below evicts (and offloads) anything
            tier.pin([*host, *swapped])
        new_blocks = self.pool.get_new_blocks(num_needed)
        held.extend(new_blocks)
        new_ids = [b.block_id for b in new_blocks]
        ids.extend(new_ids)
        if tier is not None:
            # the first new blocks are the tier's hits: copied in; the shared ones cached
            tier.load([*host, *swapped], new_ids[: len(host) + len(swapped)])
            for block, block_hash in zip(new_blocks, host):
                self.pool.cache_block(block, block_hash)
            if request.swapped is not None:  # used (or not usable): its slots go back
                tier.forget(request.swapped.keys)
                request.swapped = None
        return new_ids

    def swap_out(self, request: Request) -> None:
        """Before a running request is preempted (its blocks freed): offload the blocks the
        prefix cache cannot find again under the request's own keys (the partial last block,
        full blocks whose hash is not known yet), so it resumes without recomputing them. The
        cached ones need nothing: the pool offloads them if it ever evicts them. A tier too
        full for them all keeps the leading ones; the rest is recomputed."""
        tier = self.host_tier
        blocks = self.req_to_blocks.get(request.request_id)
        if tier is None or not blocks:
            return
        if request.swapped is not None:
            tier.forget(request.swapped.keys)
        first, n = self.num_cached.get(request.request_id, 0), request.num_computed_tokens
        keys = []
        for i in range(first, min(cdiv(n, self.block_size), len(blocks))):
            key = swap_key(request.request_id, i, n)
            if not tier.offload(blocks[i].block_id, key):
                break
            keys.append(key)
        request.swapped = SwappedKV(first, keys, n) if keys else None

    def take_host_copies(self) -> HostCopies | None:
        """The copies the step being scheduled must run first (``common/host_kv_tier.py``)."""
        return self.host_tier.take_copies() if self.host_tier is not None else None

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's full blocks covering its first ``num_tokens`` tokens."""
        start = self.num_cached.get(request.request_id, 0)
        if num_tokens // self.block_size <= start:  # no block filled since the last call
            return
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks or not self.pool.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_cached[request.request_id] = max(start, num_full)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past its first ``num_tokens`` tokens (the slots of rejected
        speculative drafts), last first. None of them is in the prefix cache: only real tokens
        are hashed, and those are all inside ``num_tokens``."""
        blocks = self.req_to_blocks.get(request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return
        assert self.num_cached.get(request_id, 0) <= keep, (request_id, keep)
        dropped = blocks[keep:]
        del blocks[keep:]
        del self.req_to_ids[request_id][keep:]
        self.req_to_version[request_id] = next(self._versions)
        self.pool.free_blocks(reversed(dropped))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (so prefixes are evicted last)."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.req_to_ids.pop(request_id, None)
        self.req_to_version.pop(request_id, None)
        self.num_cached.pop(request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (device and host tier): none may be hit again."""
        self.pool.reset_prefix_cache()
        if self.host_tier is not None:
            self.host_tier.clear()

    def check_integrity(self) -> None:
        """Every block's ref count equals the number of block tables holding it."""
        refs: dict[int, int] = {}
        for request_id, blocks in self.req_to_blocks.items():
            assert self.req_to_ids[request_id] == [b.block_id for b in blocks], request_id
            for block in blocks:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        assert set(self.req_to_ids) == set(self.req_to_blocks) == set(self.req_to_version)
        self.pool.check_integrity(refs)
