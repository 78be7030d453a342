"""Triton kernels for the paged KV cache and the fused decoder-layer ops, each beside a
plain-PyTorch ``ref_*`` twin; the native CPU kernels (C, built on first use) are reached through
``kernels.native``, ``kernels.cpu_attention`` and the ``*_cpu`` launchers.

Importing the package registers the fused ops as ``torch.ops.pdserve.*`` (``kernels.ops``):
``rms_norm``, ``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding_and_cache`` (CPU and
CUDA) and ``paged_decode_attention_cpu``; one dispatched op runs one kernel. ``sample_tokens``
(``kernels/sampler.py``) samples a step's rows: two kernels on CUDA, one native call on the CPU.

Cache layout (see docs/ARCHITECTURE.md): ``kv_cache (L, 2, N, bs, Hkv, D)``; the attention
kernels, ``reshape_and_cache`` and ``rotary_embedding_and_cache`` take one layer's view
``kv_cache[l]`` ``(2, N, bs, Hkv, D)``.

Triton reads ``TRITON_INTERPRET`` when these modules are imported: to run the kernels on CPU
tensors, set ``TRITON_INTERPRET=1`` before the first ``import kernels``.
"""

from kernels import ops
from kernels.activation import ref_silu_and_mul, silu_and_mul
from kernels.block_copy import gather_blocks, ref_gather_blocks, ref_scatter_blocks, scatter_blocks
from kernels.paged_decode_attention import paged_decode_attention, ref_paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention, ref_paged_prefill_attention
from kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache
from kernels.rms_norm import fused_add_rms_norm, ref_fused_add_rms_norm, ref_rms_norm, rms_norm
from kernels.rotary import (
    ref_rotary_embedding_and_cache,
    rope_cos_sin_cache,
    rotary_embedding_and_cache,
)

__all__ = [
    "fused_add_rms_norm",
    "gather_blocks",
    "ops",
    "paged_decode_attention",
    "paged_prefill_attention",
    "ref_fused_add_rms_norm",
    "ref_gather_blocks",
    "ref_paged_decode_attention",
    "ref_paged_prefill_attention",
    "ref_reshape_and_cache",
    "ref_rms_norm",
    "ref_rotary_embedding_and_cache",
    "ref_scatter_blocks",
    "ref_silu_and_mul",
    "reshape_and_cache",
    "rms_norm",
    "rope_cos_sin_cache",
    "rotary_embedding_and_cache",
    "scatter_blocks",
    "silu_and_mul",
]
