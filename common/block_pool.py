"""Physical KV blocks: ref counts, a free queue in eviction order, and the prefix cache.

NOTE: how freed blocks stay useful. A block whose ref count drops to zero goes to the *tail* of
the free queue but keeps its hash and its KV. Allocation takes blocks from the *head*, so the
queue is LRU order: a block freed long ago is reused (and its cache entry dropped) first, and a
prefix-cache hit on a free block simply takes it out of the queue again ("touch"). Requests free
their blocks tail-first, so the end of a sequence is evicted before its (more shareable) prefix.

```
  head (evict first)                                         tail (evicted last)
  [b7 h=…] <-> [b2 no hash] <-> [b9 h=…] <-> … <-> [b4 h=…]
```

Everything here is plain Python ints and objects: no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from common.block_hash import BlockHash


class KVCacheBlock:
    """One physical block. ``prev``/``next`` are links of the free queue (None when not in it)."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove-from-middle."""

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels keep the link updates branch-free
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens (queries = tokens looked up, hits = tokens found)."""

    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Owns every ``KVCacheBlock``; hands them out and takes them back."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        on_evict: Callable[[int, BlockHash], None] | None = None,
    ) -> None:
        """``on_evict(block_id, hash)``: called when a cached block is taken for reuse, before
        anything writes it (the host tier keeps its KV, ``common/host_kv_tier.py``)."""
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0
        self.on_evict = on_evict

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue (evicting their cache entries)."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            cached = block.block_hash
            if self.on_evict is not None and cached is not None and self.cached[cached] is block:
                self.on_evict(block.block_id, cached)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on (cache-hit) blocks, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the queue tail in the given order."""
        for block in ordered:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its hash. First writer wins on duplicates."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # another block holds the same prefix; this one stays private
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            self.num_evictions += 1
        block.block_hash = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_cnt == 0:
                self._evict(block)

    def check_integrity(self, expected_refs: dict[int, int]) -> None:
        """Raise AssertionError unless ref counts equal ``expected_refs`` (block id → holders),
        the free queue holds exactly the unreferenced blocks, and the cache map is consistent."""
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            assert block.ref_cnt == want, f"{block}: expected ref_cnt {want}"
        free_ids = [b.block_id for b in self.free_queue]
        assert len(free_ids) == len(set(free_ids)) == self.num_free_blocks
        assert set(free_ids) == {b.block_id for b in self.blocks if b.ref_cnt == 0}
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"{block} cached under another hash"
