"""Triton kernels for the paged KV cache, each beside a plain-PyTorch ``ref_*`` twin; the native
CPU decode attention lives in ``kernels.cpu_attention`` (C, built on first use).

Cache layout (see docs/ARCHITECTURE.md): ``kv_cache (L, 2, N, bs, Hkv, D)``; the attention
kernels and ``reshape_and_cache`` take one layer's view ``kv_cache[l]`` ``(2, N, bs, Hkv, D)``.

Triton reads ``TRITON_INTERPRET`` when these modules are imported: to run the kernels on CPU
tensors, set ``TRITON_INTERPRET=1`` before the first ``import kernels``.
"""

from kernels.block_copy import gather_blocks, ref_gather_blocks, ref_scatter_blocks, scatter_blocks
from kernels.paged_decode_attention import paged_decode_attention, ref_paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention, ref_paged_prefill_attention
from kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache

__all__ = [
    "gather_blocks",
    "paged_decode_attention",
    "paged_prefill_attention",
    "ref_gather_blocks",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
    "ref_reshape_and_cache",
    "ref_scatter_blocks",
    "reshape_and_cache",
    "scatter_blocks",
]
