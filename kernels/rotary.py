"""Rotary position embedding of a fused q|k|v row, with K and V written into the paged cache.

```
qkv (T, (H + 2 Hkv) * D) = [ q | k | v ]        cos_sin_cache (max_pos, D) = [ cos | sin ]
        │    │   └──────────────────────────┐                  row positions[t]
        │    └─ rotate ──▶ K ┐              ▼
        └────── rotate ──▶ q_out (T, H, D)  V ──▶ kv_cache_layer[0 | 1, slot // bs, slot % bs]
                                                   (slot = slot_mapping[t]; -1: not written)
```

Rotate-half (NeoX) RoPE as HF Llama/Qwen2 apply it: ``x * cos + rotate_half(x) * sin`` in the
model dtype, i.e. per head half ``x1 * cos - x2 * sin`` and ``x2 * cos + x1 * sin`` with each
product and each sum rounded to the model dtype, as HF's separate ops round them. The table
holds ``cos``/``sin`` of each position's frequencies already rounded to the model dtype (build
it with :func:`rope_cos_sin_cache`). Three implementations of one contract: the Triton kernel
(one program per token; CUDA; FMA contraction off), the native CPU kernel
(``csrc/fused_ops_cpu.c``: fp32 and bf16) and :func:`ref_rotary_embedding_and_cache`; all three
agree bit for bit, since no step is a reduction.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import triton
import triton.language as tl

from kernels import native
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
    kv_dtypes,
    next_power_of_two,
    report,
)
from kernels.reshape_and_cache import ref_reshape_and_cache

_MAX_HEAD_DIM = 512  # the native kernel keeps a token's cos/sin on its stack
# at::internal::GRAIN_SIZE: PyTorch's CPU ops split larger tensors between threads
_PARALLEL_GRAIN = 32768


@triton.jit
def _rotate(x1, x2, cos, sin, dtype: tl.constexpr):
    """HF's ``x * cos + rotate_half(x) * sin`` on the two halves of heads (fp32 in and out),
    each product and sum rounded to ``dtype``."""
    out1 = (x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)
    out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    return out1.to(dtype), out2.to(dtype)


# positions and slot_mapping are views into the step's input buffers, at offsets that need not
# be 16-byte aligned: not specialised on alignment, so every step runs the warmed variant.
@triton.jit(do_not_specialize_on_alignment=["positions_ptr", "slot_mapping_ptr"])
def _rotary_embedding_and_cache_kernel(
    qkv_ptr,
    positions_ptr,
    cos_sin_ptr,
    cache_ptr,
    slot_mapping_ptr,
    q_out_ptr,
    stride_qkv,
    stride_cache_kv,
    stride_cache_block,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HEADS_TILE: tl.constexpr,  # NUM_HEADS, NUM_KV_HEADS and HEAD_DIM // 2 rounded up to powers
    KV_HEADS_TILE: tl.constexpr,  # of two
    HALF_TILE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = q_out_ptr.dtype.element_ty
    d = tl.arange(0, HALF_TILE)[None, :]
    table = cos_sin_ptr + tl.load(positions_ptr + token) * HEAD_DIM + d
    cos = tl.load(table, mask=d < HALF, other=0.0).to(tl.float32)  # (1, HALF_TILE)
    sin = tl.load(table + HALF, mask=d < HALF, other=0.0).to(tl.float32)
    row = qkv_ptr + token * stride_qkv

    h = tl.arange(0, HEADS_TILE)[:, None]
    mask = (h < NUM_HEADS) & (d < HALF)
    x1 = tl.load(row + h * HEAD_DIM + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + h * HEAD_DIM + HALF + d, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    q_out = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    tl.store(q_out, out1, mask=mask)
    tl.store(q_out + HALF, out2, mask=mask)

    # slot -1 (padding) empties the mask through its bound: the interpreter mis-types
    # `scalar & vector` masks
    slot = tl.load(slot_mapping_ptr + token)
    kh = tl.arange(0, KV_HEADS_TILE)[:, None]
    mask = (kh < tl.where(slot >= 0, NUM_KV_HEADS, 0)) & (d < HALF)
    k = row + NUM_HEADS * HEAD_DIM + kh * HEAD_DIM + d
    v = k + NUM_KV_HEADS * HEAD_DIM
    x1 = tl.load(k, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(k + HALF, mask=mask, other=0.0).to(tl.float32)
    out1, out2 = _rotate(x1, x2, cos, sin, dtype)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k_dst = cache_ptr + block * stride_cache_block + offset * (NUM_KV_HEADS * HEAD_DIM)
    k_dst += kh * HEAD_DIM + d
    kv_dtype = cache_ptr.dtype.element_ty
    tl.store(k_dst, _to_cache(out1, kv_dtype), mask=mask)
    tl.store(k_dst + HALF, _to_cache(out2, kv_dtype), mask=mask)
    v1, v2 = tl.load(v, mask=mask), tl.load(v + HALF, mask=mask)
    tl.store(k_dst + stride_cache_kv, _to_cache(v1, kv_dtype), mask=mask)
    tl.store(k_dst + stride_cache_kv + HALF, _to_cache(v2, kv_dtype), mask=mask)


@triton.jit
def _to_cache(x, kv_dtype: tl.constexpr):
    """A model-dtype value as the cache holds it: itself, or FP8 e4m3 (:func:`_round_e4m3`)."""
    if kv_dtype == tl.float8e4nv:
        x = _round_e4m3(x.to(tl.float32))
    return x.to(kv_dtype)


@triton.jit
def _round_e4m3(x):
    """fp32 ``x`` rounded to the nearest e4m3 value (ties to even), saturated to +-448: torch's
    conversion, done here in fp32 so that the cast after it is exact (the interpreter's own
    fp32 -> fp8 cast drops the carry of a mantissa that rounds up into the exponent). Normal
    values keep 3 mantissa bits (rounded at bit 20); below 2^-6 the step is 2^-9, which adding
    and taking away 2^14 rounds to; the sign is put back (a negative tiny value stays -0)."""
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    tiny = ((tl.abs(x) + 16384.0) - 16384.0).to(tl.uint32, bitcast=True)
    tiny = (tiny | (bits & 0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, tiny, normal)


# The op's arguments in its schema's order: (qkv, positions, cos_sin_cache, kv_cache_layer,
# slot_mapping, num_heads, num_kv_heads). The launchers hand them to the checks as one tuple.
_Args = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int]


def _check_args(args: _Args) -> None:
    """Shared by all implementations. A valid call (once per layer per step) is vetted by one
    cheap expression; the ``kernels._common`` checks explain a failure."""
    qkv, positions, cos_sin_cache, kv, slot_mapping, num_heads, num_kv_heads = args
    if kv.dim() == 5 and qkv.dim() == 2 and cos_sin_cache.dim() == 2:  # the shapes to read
        two, _, _, kv_heads, head_dim = kv.shape
        num_tokens, width = qkv.shape
        dtype = qkv.dtype
        ok = (
            two == 2
            and kv_heads == num_kv_heads
            and 0 < num_kv_heads <= num_heads
            and num_heads % num_kv_heads == 0
            and head_dim % 2 == 0
            and head_dim <= _MAX_HEAD_DIM
            and dtype in FLOAT_DTYPES
            and kv.dtype in kv_dtypes(dtype)
            and kv.stride()[2:] == (num_kv_heads * head_dim, head_dim, 1)
            and width == (num_heads + 2 * num_kv_heads) * head_dim
            and qkv.stride(1) == 1
            and cos_sin_cache.shape[1] == head_dim
            and cos_sin_cache.is_contiguous()
            and positions.shape == slot_mapping.shape == (num_tokens,)
            and positions.is_contiguous()
            and slot_mapping.is_contiguous()
            and qkv.dtype == cos_sin_cache.dtype == dtype
            and positions.dtype == slot_mapping.dtype == torch.int64
            and qkv.device == cos_sin_cache.device == kv.device
            and positions.device == slot_mapping.device == kv.device
        )
        if ok:
            return
    _explain(args)


def _explain(args: _Args) -> NoReturn:
    qkv, positions, cos_sin_cache, kv, slot_mapping, num_heads, num_kv_heads = args
    check_shape("kv_cache_layer", kv, (2, None, None, num_kv_heads, None))
    head_dim = kv.shape[-1]
    check(
        0 < num_kv_heads <= num_heads and num_heads % num_kv_heads == 0,
        f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})",
    )
    check(
        head_dim % 2 == 0 and head_dim <= _MAX_HEAD_DIM,
        f"head_dim must be even and <= {_MAX_HEAD_DIM}, got {head_dim}",
    )
    check_dtype("qkv", qkv, FLOAT_DTYPES)
    check_dtype("kv_cache_layer", kv, kv_dtypes(qkv.dtype))
    check_inner_contiguous("kv_cache_layer", kv, 3)
    check_shape("qkv", qkv, (None, (num_heads + 2 * num_kv_heads) * head_dim))
    check_inner_contiguous("qkv", qkv, 1)
    check_shape("cos_sin_cache", cos_sin_cache, (None, head_dim))
    check_dtype("cos_sin_cache", cos_sin_cache, (qkv.dtype,))
    check(cos_sin_cache.is_contiguous(), "cos_sin_cache must be contiguous")
    for name, index in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_shape(name, index, (qkv.shape[0],))
        check_dtype(name, index, (torch.int64,))
        check(index.is_contiguous(), f"{name} must be contiguous")
    check_same_device(qkv=qkv, kv_cache_layer=kv, cos_sin_cache=cos_sin_cache)
    check_same_device(qkv=qkv, positions=positions, slot_mapping=slot_mapping)
    raise ValueError(  # left: a unit-size dim with another stride, which _check_args refuses
        f"rotary needs densely packed heads: qkv strides {tuple(qkv.stride())}, "
        f"kv_cache_layer strides {tuple(kv.stride())}"
    )


def rotary_embedding_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate q and k of each token by its position; write K and V into its cache slot (Triton).

    Args:
        qkv: ``(T, (H + 2 Hkv) * D)``, the fused projection's output; rows dense, the row stride
            free. Not modified.
        positions: ``(T,)`` int64, each in ``[0, max_pos)`` (not checked: it would sync).
        cos_sin_cache: ``(max_pos, D)``, ``qkv``'s dtype, contiguous: row p is
            ``[cos(p f) | sin(p f)]`` (:func:`rope_cos_sin_cache`).
        kv_cache_layer: ``(2, N, bs, Hkv, D)``, ``[0]`` = K, ``[1]`` = V; ``(bs, Hkv, D)``
            dense. Mutated: exactly the slots named in ``slot_mapping``.
        slot_mapping: ``(T,)`` int64, ``slot = block_id * bs + offset``; ``-1`` skips the token
            (padding; its position may be anything in range, e.g. 0). Slots must be distinct
            and ``< N * bs`` (not checked: it would sync).
        num_heads, num_kv_heads: ``H`` and ``Hkv``.

    Returns the rotated queries, a new contiguous ``(T, H, D)`` tensor.
    """
    _check_args(
        (qkv, positions, cos_sin_cache, kv_cache_layer, slot_mapping, num_heads, num_kv_heads)
    )
    check_runnable(_rotary_embedding_and_cache_kernel, qkv.device)
    num_tokens, head_dim = qkv.shape[0], kv_cache_layer.shape[-1]
    q_out = qkv.new_empty(num_tokens, num_heads, head_dim)
    if num_tokens == 0:
        return q_out
    _rotary_embedding_and_cache_kernel[(num_tokens,)](
        qkv,
        positions,
        cos_sin_cache,
        kv_cache_layer,
        slot_mapping,
        q_out,
        qkv.stride(0),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache_layer.shape[2],
        HEADS_TILE=next_power_of_two(num_heads),
        KV_HEADS_TILE=next_power_of_two(num_kv_heads),
        HALF_TILE=next_power_of_two(head_dim // 2),
        enable_fp_fusion=False,  # x1 * cos + ... must round the product before the sum
    )
    return q_out


def rotary_embedding_and_cache_cpu(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """:func:`rotary_embedding_and_cache` on CPU tensors by the native kernel (float16, or no
    compiler: the ref). Positions and slots are checked here (they are on the host): one out of
    range raises ``ValueError`` before anything is written."""
    args = (qkv, positions, cos_sin_cache, kv_cache_layer, slot_mapping, num_heads, num_kv_heads)
    _check_args(args)
    native.check_cpu(qkv)  # the others are on qkv's device
    lib = native.library_for(qkv.dtype)
    if lib is None:
        return ref_rotary_embedding_and_cache(*args)
    _, num_blocks, block_size, _, head_dim = kv_cache_layer.shape
    num_tokens = qkv.shape[0]
    cache_strides = kv_cache_layer.stride()
    q_out = qkv.new_empty(num_tokens, num_heads, head_dim)
    failed = lib.pdserve_rotary_embedding_and_cache(
        q_out.data_ptr(),
        kv_cache_layer.data_ptr(),
        qkv.data_ptr(),
        positions.data_ptr(),
        cos_sin_cache.data_ptr(),
        slot_mapping.data_ptr(),
        num_tokens,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        qkv.stride(0),
        cache_strides[0],
        cache_strides[1],
        cos_sin_cache.shape[0],
        num_blocks * block_size,
        native.DTYPE_CODES[qkv.dtype],
        native.CACHE_DTYPE_CODES[kv_cache_layer.dtype],
        torch.get_num_threads(),
    )
    if failed:
        raise ValueError(
            f"a position is outside the cos/sin table ({cos_sin_cache.shape[0]} rows) or a slot "
            f"outside the cache ({num_blocks * block_size} slots); nothing was written"
        )
    return q_out


def ref_rotary_embedding_and_cache(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` op for op, then :func:`ref_reshape_and_cache` of the
    rotated K and the V (same contract, any device)."""
    num_tokens, head_dim = qkv.shape[0], cos_sin_cache.shape[1]
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q, k, v = qkv.split(sizes, dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # (T, H, D)
    k = k.view(num_tokens, num_kv_heads, head_dim)  # (T, Hkv, D)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # (T, D/2) each
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)  # (T, 1, D): HF's cos(cat(freqs, freqs))
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    q_embed = (q * cos) + (_rotate_half(q) * sin)
    k_embed = (k * cos) + (_rotate_half(k) * sin)
    ref_reshape_and_cache(k_embed, v, kv_cache_layer, slot_mapping)
    return q_embed.contiguous()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF's ``rotate_half``."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, max_positions: int, dtype: torch.dtype
) -> torch.Tensor:
    """The ``cos_sin_cache`` of :func:`rotary_embedding_and_cache`, holding exactly HF's values.

    ``inv_freq``: the ``(D/2,)`` inverse frequencies (fp32; with any rope scaling applied).
    Row ``p`` is ``[cos(p f) | sin(p f)]``, computed as HF's ``LlamaRotaryEmbedding`` does: the
    fp32 product, fp32 cos and sin over ``cat((freqs, freqs))``, then rounded to ``dtype`` (its
    ``attention_scaling`` is 1 for the default, linear and llama3 rope types). Returns
    ``(max_positions, D)`` in ``dtype`` on ``inv_freq``'s device.

    PyTorch's CPU cos/sin take the vectorised (SLEEF) path on whole vectors and libm on a
    remainder, and split a tensor above its parallel grain into per-thread chunks with
    remainders of their own; the table is computed in slices below the grain, so that every
    value comes from the vectorised path, as in HF's per-step call on a few positions.
    """
    half = inv_freq.shape[0]
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    slices = emb.split(max(_PARALLEL_GRAIN // emb.shape[1], 1))
    cos = torch.cat([part.cos() for part in slices])
    sin = torch.cat([part.sin() for part in slices])
    return torch.cat((cos[:, :half], sin[:, :half]), dim=-1).to(dtype)


def benchmark() -> None:
    """Bandwidth of one 8k-token prefill step's RoPE + cache write, Llama-3-8B heads, bf16."""
    device = cuda_or_explain("rotary_embedding_and_cache")
    if device is None:
        return
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 8192, 32, 8, 128, 16
    dtype = torch.bfloat16
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, dtype=dtype, device=device)
    positions = torch.arange(num_tokens, device=device)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    cos_sin_cache = rope_cos_sin_cache(inv_freq, num_tokens, dtype)
    num_blocks = 2 * num_tokens // block_size
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.zeros(shape, dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    ms = bench_ms(
        lambda: rotary_embedding_and_cache(
            qkv, positions, cos_sin_cache, cache, slots, num_heads, num_kv_heads
        )
    )
    # qkv read once; q out, K and V written once; the cos/sin rows read once per token
    nbytes = num_tokens * (2 * width + head_dim) * qkv.element_size()
    report(f"rotary_embedding_and_cache T={num_tokens} H={num_heads}", ms, device, nbytes=nbytes)


if __name__ == "__main__":
    benchmark()
