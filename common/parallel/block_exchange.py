"""Whole KV blocks (every KV head: the store's layout) to and from the ranks' head slices.

Under tensor parallelism each rank's paged cache holds only its KV heads, but a store entry
holds all of them (``(L, 2, bs, Hkv, D)`` per block, as at TP=1): that is what lets a prefill
pool at one TP size feed a decode pool at another, and why the store fingerprint names the full
head count, never the TP size. Rank 0 is the group's only store client; these two collectives
move head slices between it and the other ranks over the device group (NCCL on GPU: NVLink,
not the host):

```
land     rank 0: full (L, n, 2, bs, Hkv, D) ──scatter──▶ rank k: (L, n, 2, bs, Hk, D) → its cache
collect  rank k: its cache's blocks (L, n, 2, bs, Hk, D) ──gather──▶ rank 0: full
```

With fewer KV heads than ranks a head lives on several ranks (``TensorParallel.kv_head_range``):
``land`` sends it to each, ``collect`` keeps one copy. Every rank calls the same function with
the same block ids, in the same order (``common/parallel/executor.py`` broadcasts them).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from common.parallel.group import TensorParallel, kv_head_range


class BlockExchange(Protocol):
    """What the store connector's worker half calls under tensor parallelism (rank 0)."""

    def land_blocks(self, block_ids: list[int], full: torch.Tensor) -> None:
        """Write ``full`` (``(L, n, 2, bs, Hkv, D)``, any device) into blocks ``block_ids`` of
        every rank's cache, each rank its heads."""

    def collect_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks ``block_ids`` of every rank's cache, as ``(L, n, 2, bs, Hkv, D)`` on the
        cache's device."""


def head_ranges(tp: TensorParallel, num_kv_heads: int) -> list[tuple[int, int]]:
    """Every rank's ``[begin, end)`` of the KV heads, by rank."""
    return [kv_head_range(rank, tp.size, num_kv_heads) for rank in range(tp.size)]


def land(
    tp: TensorParallel,
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_kv_heads: int,
    full: torch.Tensor | None,
) -> None:
    """Every rank: write its heads of ``full`` (rank 0's, ``None`` elsewhere) into its blocks
    ``block_ids`` (int64 on the cache's device) of ``kv_cache`` ``(L, 2, N, bs, Hk, D)``."""
    num_layers, _, _, bs, local_heads, head_dim = kv_cache.shape
    n = block_ids.numel()
    mine = kv_cache.new_empty((num_layers, n, 2, bs, local_heads, head_dim))
    parts = None
    if tp.rank == 0:
        assert full is not None
        full = full.to(kv_cache.device)
        parts = [full[..., lo:hi, :].contiguous() for lo, hi in head_ranges(tp, num_kv_heads)]
    dist.scatter(mine, parts, src=0, group=tp.device_group)
    kv_cache.index_copy_(2, block_ids, mine.transpose(1, 2))


def collect(
    tp: TensorParallel, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_kv_heads: int
) -> torch.Tensor | None:
    """Every rank: send its heads of blocks ``block_ids``; rank 0 gets the full blocks
    ``(L, n, 2, bs, Hkv, D)``, the others None."""
    mine = kv_cache.index_select(2, block_ids).transpose(1, 2).contiguous()
    parts = [torch.empty_like(mine) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(mine, parts, dst=0, group=tp.device_group)
    if parts is None:
        return None
    num_layers, n, _, bs, _, head_dim = mine.shape
    full = mine.new_empty((num_layers, n, 2, bs, num_kv_heads, head_dim))
    for (lo, hi), part in zip(head_ranges(tp, num_kv_heads), parts):
        full[..., lo:hi, :] = part  # a replicated head: the same bytes from each of its ranks
    return full
