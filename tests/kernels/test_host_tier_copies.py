"""The host KV tier's CUDA copy path (``HostKVTier.copy_staged``: the block packing kernels and
one copy per run of consecutive slots) gives the per-block copies' result; on CPU through
Triton's interpreter."""

from __future__ import annotations

import torch

from common.host_kv_tier import HostCopies, HostKVTier


def test_staged_copies_equal_per_block_copies(device):
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 12, 4, 2, 8, generator=g)  # (L, 2, N, bs, Hkv, D)
    # offloads into two runs of slots and a lone one; loads from a run and a lone slot,
    # into blocks that were just offloaded (offloads first)
    copies = HostCopies([(3, 0), (7, 1), (2, 2), (9, 5), (4, 6)], [(1, 3), (2, 8), (6, 11)])
    want_cache = cache.clone()
    want = HostKVTier(8, want_cache)
    want.host.zero_()
    want.copy(copies, want_cache)  # the CPU path: one strided copy per block
    got_cache = cache.clone().to(device)
    got = HostKVTier(8, got_cache)
    got.host.zero_()
    got.copy_staged(copies, got_cache)
    assert torch.equal(got.host.cpu(), want.host)
    assert torch.equal(got_cache.cpu(), want_cache)
    assert torch.equal(want_cache[:, :, 3], cache[:, :, 7])  # slot 1 (block 7) loaded into 3
