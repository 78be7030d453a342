"""Write a step's new keys and values into one layer of the paged KV cache.

```
key/value (T, Hkv, D)           kv_cache_layer (2, N, bs, Hkv, D)
token t ── slot_mapping[t] ──▶  [0 | 1, slot // bs, slot % bs, :, :]
```

One program copies one tile of one token's ``Hkv * D`` row, for K and V together.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    bench_ms,
    check,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    check_same_device,
    check_shape,
    cuda_or_explain,
    next_power_of_two,
    report,
)

_MAX_TILE = 1024


@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])  # a view of the step's buffers
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_key_t,
    stride_value_t,
    stride_cache_kv,
    stride_cache_block,
    ROW: tl.constexpr,  # Hkv * D: one token's elements, dense in key, value and the cache
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    slot = tl.load(slot_mapping_ptr + token)
    # slot -1 marks padding: an empty row makes the whole program a no-op. (Folding the
    # condition into the bound, rather than `& (slot >= 0)`, also keeps the interpreter happy:
    # it mis-types scalar & vector masks.)
    mask = cols < tl.where(slot >= 0, ROW, 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = cache_ptr + block * stride_cache_block + offset * ROW + cols
    k = tl.load(key_ptr + token * stride_key_t + cols, mask=mask)
    v = tl.load(value_ptr + token * stride_value_t + cols, mask=mask)
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_cache_kv, v, mask=mask)


def _check_args(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    check_shape("kv_cache_layer", kv_cache_layer, (2, None, None, None, None))
    _, _, _, num_kv_heads, head_dim = kv_cache_layer.shape
    check_shape("key", key, (None, num_kv_heads, head_dim))
    num_tokens = key.shape[0]
    check_shape("value", value, (num_tokens, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_dtype("kv_cache_layer", kv_cache_layer, FLOAT_DTYPES)
    check_dtype("key", key, (kv_cache_layer.dtype,))
    check_dtype("value", value, (kv_cache_layer.dtype,))
    check_dtype("slot_mapping", slot_mapping, (torch.int64,))
    check_inner_contiguous("key", key, 2)
    check_inner_contiguous("value", value, 2)
    check_inner_contiguous("kv_cache_layer", kv_cache_layer, 3)
    check(slot_mapping.is_contiguous(), "slot_mapping must be contiguous")
    check_same_device(
        key=key, value=value, kv_cache_layer=kv_cache_layer, slot_mapping=slot_mapping
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new tokens' K/V into their cache slots, in place.

    Args:
        key, value: ``(T, Hkv, D)``, the cache's dtype; the last two dims dense, the token
            stride free (slices of a fused qkv projection work).
        kv_cache_layer: ``(2, N, bs, Hkv, D)``, ``[0]`` = K, ``[1]`` = V; ``(bs, Hkv, D)`` dense.
            Mutated: exactly the slots named in ``slot_mapping``.
        slot_mapping: ``(T,)`` int64, ``slot = block_id * bs + offset``; ``-1`` skips the token
            (padding). Slots must be distinct and ``< N * bs`` (not checked: it would sync).
    """
    _check_args(key, value, kv_cache_layer, slot_mapping)
    check_runnable(_reshape_and_cache_kernel, key.device)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    row = num_kv_heads * head_dim
    tile = min(next_power_of_two(row), _MAX_TILE)
    grid = (num_tokens, triton.cdiv(row, tile))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        kv_cache_layer,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        ROW=row,
        BLOCK_SIZE=block_size,
        TILE=tile,
    )


def ref_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-PyTorch :func:`reshape_and_cache` (same contract, any device, any strides)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    block_size = kv_cache_layer.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    dtype = kv_cache_layer.dtype  # an FP8 cache: torch's conversion (nearest even, saturating)
    kv_cache_layer[0, blocks, offsets] = key[valid].to(dtype)
    kv_cache_layer[1, blocks, offsets] = value[valid].to(dtype)


def benchmark() -> None:
    """Bandwidth of caching one 8k-token prefill step, Llama-3-8B layer shapes, bf16."""
    device = cuda_or_explain("reshape_and_cache")
    if device is None:
        return
    num_tokens, num_kv_heads, head_dim, block_size = 8192, 8, 128, 16
    num_blocks = 4 * num_tokens // block_size
    cache = torch.zeros(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device
    )
    key = torch.randn(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    ms = bench_ms(lambda: reshape_and_cache(key, value, cache, slots))
    # K and V are read once and written once; the slot ids are read once.
    nbytes = 4 * key.numel() * key.element_size() + slots.numel() * 8
    report(
        f"reshape_and_cache T={num_tokens} Hkv={num_kv_heads} D={head_dim}",
        ms,
        device,
        nbytes=nbytes,
    )


if __name__ == "__main__":
    benchmark()
