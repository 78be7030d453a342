"""Copy whole KV blocks, all layers at once, between the paged cache and a packed buffer.

```
kv_cache (L, 2, N, bs, Hkv, D)            packed (n, L, 2, bs, Hkv, D)
kv_cache[l, kv, block_ids[i]]   <──────>  packed[i, l, kv]        (bs * Hkv * D elements)
```

``packed[i]`` is exactly the payload of one KV store entry, so the prefill side saves with one
``gather_blocks`` and the decode side loads with one ``scatter_blocks``, each a single launch
over (block, layer * K/V, tile) instead of ``n * L`` small copies.
"""

from __future__ import annotations

import functools
import math

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

# Raw copies do not care about the element type; fp8 caches move like any other.
COPY_DTYPES = (*FLOAT_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
_MAX_TILE = 4096


@triton.jit(do_not_specialize_on_alignment=["block_ids_ptr"])  # ids may be a slice of a list
def _block_copy_kernel(
    cache_ptr,
    packed_ptr,
    block_ids_ptr,
    stride_cache_layer,
    stride_cache_kv,
    stride_cache_block,
    BLOCK_NUMEL: tl.constexpr,  # bs * Hkv * D: one block of one layer's K or V, dense
    TILE: tl.constexpr,
    TO_CACHE: tl.constexpr,  # False: gather cache -> packed; True: scatter packed -> cache
):
    i = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1)  # = layer * 2 + kv, the packed layout's order
    cols = tl.program_id(2) * TILE + tl.arange(0, TILE)
    mask = cols < BLOCK_NUMEL
    block = tl.load(block_ids_ptr + i)
    layer = (layer_kv // 2).to(tl.int64)
    cache_offset = layer * stride_cache_layer + (layer_kv % 2) * stride_cache_kv
    cache_ptrs = cache_ptr + cache_offset + block * stride_cache_block + cols
    packed_ptrs = packed_ptr + (i * tl.num_programs(1) + layer_kv) * BLOCK_NUMEL + cols
    if TO_CACHE:
        tl.store(cache_ptrs, tl.load(packed_ptrs, mask=mask), mask=mask)
    else:
        tl.store(packed_ptrs, tl.load(cache_ptrs, mask=mask), mask=mask)


def _check_args(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor, packed_name: str
) -> None:
    check_shape("kv_cache", kv_cache, (None, 2, None, None, None, None))
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    check_shape("block_ids", block_ids, (None,))
    shape = (block_ids.shape[0], num_layers, 2, block_size, num_kv_heads, head_dim)
    check_shape(packed_name, packed, shape)
    check_dtype("kv_cache", kv_cache, COPY_DTYPES)
    check_dtype(packed_name, packed, (kv_cache.dtype,))
    check_dtype("block_ids", block_ids, (torch.int64,))
    check_inner_contiguous("kv_cache", kv_cache, 3)
    check(packed.is_contiguous(), f"{packed_name} must be contiguous")
    check(block_ids.is_contiguous(), "block_ids must be contiguous")
    check_same_device(**{"kv_cache": kv_cache, "block_ids": block_ids, packed_name: packed})


def _launch(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, packed: torch.Tensor, to_cache: bool
) -> None:
    check_runnable(_block_copy_kernel, kv_cache.device)
    num_layers = kv_cache.shape[0]
    block_numel = math.prod(kv_cache.shape[3:])
    if block_ids.numel() == 0 or block_numel == 0 or num_layers == 0:
        return
    tile = min(next_power_of_two(block_numel), _MAX_TILE)
    grid = (block_ids.shape[0], num_layers * 2, triton.cdiv(block_numel, tile))
    _block_copy_kernel[grid](
        kv_cache,
        packed,
        block_ids,
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        BLOCK_NUMEL=block_numel,
        TILE=tile,
        TO_CACHE=to_cache,
    )


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Pack blocks ``block_ids`` of every layer into ``(n, L, 2, bs, Hkv, D)``.

    Args:
        kv_cache: ``(L, 2, N, bs, Hkv, D)`` with ``(bs, Hkv, D)`` dense; not modified.
        block_ids: ``(n,)`` int64 on the cache's device, each in ``[0, N)`` (not checked: it
            would sync). Repeats are allowed.
        out: optional contiguous ``(n, L, 2, bs, Hkv, D)`` destination, same dtype and device.

    Returns:
        ``out`` (or a new tensor): ``out[i, l, kv] == kv_cache[l, kv, block_ids[i]]``.
    """
    check_shape("kv_cache", kv_cache, (None, 2, None, None, None, None))
    check_shape("block_ids", block_ids, (None,))
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    if out is None:
        shape = (block_ids.shape[0], num_layers, 2, block_size, num_kv_heads, head_dim)
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    _check_args(kv_cache, block_ids, out, "out")
    _launch(kv_cache, block_ids, out, to_cache=False)
    return out


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Write packed blocks back: ``kv_cache[l, kv, block_ids[i]] = src[i, l, kv]``, in place.

    Args:
        kv_cache: ``(L, 2, N, bs, Hkv, D)`` with ``(bs, Hkv, D)`` dense; mutated at exactly the
            blocks in ``block_ids``.
        block_ids: ``(n,)`` int64, distinct, each in ``[0, N)`` (not checked: it would sync).
        src: contiguous ``(n, L, 2, bs, Hkv, D)``, the cache's dtype and device.
    """
    _check_args(kv_cache, block_ids, src, "src")
    _launch(kv_cache, block_ids, src, to_cache=True)


def ref_gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch :func:`gather_blocks`."""
    return kv_cache[:, :, block_ids].permute(2, 0, 1, 3, 4, 5).contiguous()


def ref_scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Plain-PyTorch :func:`scatter_blocks`."""
    kv_cache[:, :, block_ids] = src.permute(1, 2, 0, 3, 4, 5)


def benchmark() -> None:
    """Bandwidth of packing / unpacking n blocks of all layers, Llama-3-8B shapes, bf16."""
    device = cuda_or_explain("gather_blocks / scatter_blocks")
    if device is None:
        return
    num_layers, num_kv_heads, head_dim, block_size, num_blocks = 32, 8, 128, 16, 1024
    cache = torch.randn(
        num_layers,
        2,
        num_blocks,
        block_size,
        num_kv_heads,
        head_dim,
        dtype=torch.bfloat16,
        device=device,
    )
    # 1 block: one store entry; 64: a 1k-token prompt; 512: an 8k-token prompt.
    for n in (1, 64, 512):
        block_ids = torch.randperm(num_blocks, device=device)[:n]
        packed = gather_blocks(cache, block_ids)
        # Each copied element is read once and written once.
        nbytes = 2 * packed.numel() * packed.element_size()
        ms = bench_ms(functools.partial(gather_blocks, cache, block_ids, out=packed))
        report(f"gather_blocks  n={n:4d} L={num_layers}", ms, device, nbytes=nbytes)
        ms = bench_ms(functools.partial(scatter_blocks, cache, block_ids, packed))
        report(f"scatter_blocks n={n:4d} L={num_layers}", ms, device, nbytes=nbytes)


if __name__ == "__main__":
    benchmark()
