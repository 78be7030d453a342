"""Decode attention over the paged KV cache: one query token per sequence, split-K.

NOTE: a decode step has few queries (one per sequence) and long contexts, so parallelising over
(sequence, head) alone leaves most of the GPU idle. Flash-decoding splits each context into
partitions of ``partition_size`` tokens, one program per (sequence, kv head, partition):

```
context of seq s:  |--- partition 0 ---|--- partition 1 ---|-- p2 --|
                           │                    │              │
                  (max, sum, acc) fp32  (max, sum, acc)  (max, sum, acc)   pass 1
                           └────────── log-sum-exp merge ──────┘           pass 2 -> out
```

A program serves all ``H // Hkv`` query heads that share its kv head (GQA), so each K/V tile is
read from HBM once per group, and the group's queries form the rows of one ``tl.dot``. Contexts
that fit one partition skip pass 2: the program normalises and writes the output itself.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    bench_ms,
    check_paged_attention_args,
    check_power_of_two,
    check_runnable,
    check_shape,
    cuda_or_explain,
    interpreted,
    next_power_of_two,
    paged_slots,
    report,
    tile_dot,
)

DEFAULT_PARTITION_SIZE = 512  # tokens per split-K partition
_MAX_BLOCK_N = 64  # keys per inner tile
_MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows; small GQA groups are padded up to it


# The block-table row stride and the partition count change from step to step (an eager step's
# widest table): specialised on (== 1, % 16) they would compile new variants mid-serving, for no
# gain. The int32 metadata sit at fixed offsets of the step's input buffers, aligned or not.
@triton.jit(
    do_not_specialize=["stride_bt_s", "num_partitions"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"],
)
def _paged_decode_attention_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    partial_out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_q_s,
    stride_q_h,
    stride_out_s,
    stride_out_h,
    stride_cache_kv,
    stride_cache_block,
    stride_bt_s,
    num_partitions,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV padded to a tl.dot-friendly power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    SINGLE_PARTITION: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only, see tile_dot
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, seq_len)

    rows = tl.arange(0, GROUP_ROWS)
    row_mask = rows < QUERIES_PER_KV
    heads = kv_head * QUERIES_PER_KV + rows
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)  # (GROUP_ROWS, D)

    m_i = tl.full([GROUP_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_ROWS], tl.float32)
    acc = tl.zeros([GROUP_ROWS, HEAD_DIM], tl.float32)
    k_base = cache_ptr + kv_head * HEAD_DIM
    v_base = k_base + stride_cache_kv
    # An empty partition (start >= seq_len) skips the loop and leaves (-inf, 0, 0): the merge
    # never reads it, and a padded row (seq_len == 0) comes out as zeros.
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < end
        slot = paged_slots(
            block_tables_ptr, stride_bt_s, seq, pos, valid, stride_cache_block,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
        )  # fmt: skip
        k = tl.load(k_base + slot[None, :] + dims[:, None], mask=valid[None, :], other=0.0)
        s = tile_dot(q, k, DOT_PRECISION, UPCAST) * qk_scale  # (GROUP_ROWS, BLOCK_N)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    if SINGLE_PARTITION:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_ptrs = out_ptr + seq * stride_out_s + heads[:, None] * stride_out_h + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
    else:
        # Scratch is (S, H, P) and (S, H, P, D), fp32, dense.
        idx = (seq * NUM_KV_HEADS * QUERIES_PER_KV + heads) * num_partitions + part
        tl.store(max_logits_ptr + idx, m_i, mask=row_mask)
        tl.store(exp_sums_ptr + idx, l_i, mask=row_mask)
        acc_ptrs = partial_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :]
        tl.store(acc_ptrs, acc, mask=row_mask[:, None])


@triton.jit(do_not_specialize=["num_partitions"], do_not_specialize_on_alignment=["seq_lens_ptr"])
def _paged_decode_reduce_kernel(
    out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    partial_out_ptr,
    seq_lens_ptr,
    stride_out_s,
    stride_out_h,
    num_partitions,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
    PARTITIONS_POW2: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Clamped so a seq_len above the launcher's max_seq_len truncates instead of reading past
    # the scratch.
    used = tl.minimum(tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION_SIZE), num_partitions)
    base = (seq * NUM_HEADS + head) * num_partitions
    parts = tl.arange(0, PARTITIONS_POW2)
    m = tl.load(max_logits_ptr + base + parts, mask=parts < used, other=float("-inf"))
    sums = tl.load(exp_sums_ptr + base + parts, mask=parts < used, other=0.0)
    # A padded row has no partition at all; 0 keeps exp2(m - m_max) away from -inf - -inf.
    m_max = tl.where(used > 0, tl.max(m, 0), 0.0)
    denom = tl.sum(tl.exp2(m - m_max) * sums, 0)
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for p in range(0, used):
        weight = tl.exp2(tl.load(max_logits_ptr + base + p) - m_max)
        acc += weight * tl.load(partial_out_ptr + (base + p) * HEAD_DIM + dims)
    out = acc / tl.where(denom > 0, denom, 1.0)
    out_ptrs = out_ptr + seq * stride_out_s + head * stride_out_h + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


def _check_args(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    partition_size: int,
    out: torch.Tensor | None,
) -> None:
    check_paged_attention_args(q, kv_cache_layer, block_tables, seq_lens, out)
    check_shape("block_tables", block_tables, (q.shape[0], None))  # one query per sequence
    check_power_of_two("partition_size", partition_size, minimum=16)


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    partition_size: int = DEFAULT_PARTITION_SIZE,
    *,
    max_seq_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one new query token per sequence over its whole cached context.

    Args:
        q: ``(S, H, D)``, the cache's dtype, last dim dense. Query head ``h`` reads kv head
            ``h // (H // Hkv)``.
        kv_cache_layer: ``(2, N, bs, Hkv, D)`` with ``(bs, Hkv, D)`` dense; not modified.
            ``D`` a power of two >= 16, ``bs`` a power of two.
        block_tables: ``(S, max_blocks)`` int32; only the first ``cdiv(seq_lens[s], bs)``
            entries of a row are read.
        seq_lens: ``(S,)`` int32, tokens cached per sequence, the new one included;
            ``0`` marks a padded row, whose output is zeros. ``<= max_blocks * bs``.
        scale: softmax scale, usually ``D ** -0.5``.
        partition_size: tokens per split-K partition, a power of two >= 16.
        max_seq_len: optional host-side bound on ``seq_lens`` that trims the grid and scratch;
            default ``max_blocks * bs``. No device sync either way (CUDA-graph safe). A row
            longer than the bound attends to its first ``cdiv(max_seq_len, partition_size)``
            partitions only: wrong, but never out of bounds.
        out: optional ``(S, H, D)`` destination, q's dtype, last dim dense.

    Returns:
        ``(S, H, D)`` in q's dtype (``out`` when given); fp32 softmax and accumulation.
    """
    _check_args(q, kv_cache_layer, block_tables, seq_lens, partition_size, out)
    check_runnable(_paged_decode_attention_kernel, q.device)
    num_seqs, num_heads, head_dim = q.shape
    block_size = kv_cache_layer.shape[2]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if num_seqs == 0 or num_heads == 0:
        return out
    num_partitions = num_partitions_for(max_seq_len, partition_size)
    scratch = _scratch(num_seqs, num_heads, num_partitions, head_dim, q.device)
    _launch_partitions(
        q, kv_cache_layer, block_tables, seq_lens, scale, partition_size, out, scratch
    )
    if num_partitions > 1:
        _launch_reduce(out, scratch, seq_lens, partition_size)
    return out


def num_partitions_for(max_seq_len: int, partition_size: int = DEFAULT_PARTITION_SIZE) -> int:
    """Split-K partitions of a launch: 1 runs the single-partition variant, more run pass 2
    too, whose variant is the count rounded up to a power of two (``PARTITIONS_POW2``)."""
    return max(triton.cdiv(max_seq_len, partition_size), 1)


class _Scratch(NamedTuple):
    """Pass 1's per-partition results, fp32, dense: (S, H, P), (S, H, P), (S, H, P, D)."""

    max_logits: torch.Tensor  # base-2 running max of the scaled logits
    exp_sums: torch.Tensor  # sum of exp2(logit - max)
    partial_out: torch.Tensor  # unnormalised sum of weights * V
    num_partitions: int


def _scratch(
    num_seqs: int, num_heads: int, num_partitions: int, head_dim: int, device: torch.device
) -> _Scratch:
    """Scratch for ``num_partitions``; placeholders when it is 1 (no pass 2)."""
    if num_partitions == 1:
        # Never dereferenced: the single-partition kernel writes the output directly.
        placeholder = torch.empty(1, dtype=torch.float32, device=device)
        return _Scratch(placeholder, placeholder, placeholder, 1)
    shape = (num_seqs, num_heads, num_partitions)
    return _Scratch(
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
        num_partitions,
    )


def _launch_partitions(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    partition_size: int,
    out: torch.Tensor,
    scratch: _Scratch,
) -> None:
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
    num_partitions = scratch.num_partitions
    queries_per_kv = num_heads // num_kv_heads
    grid = (num_seqs, num_kv_heads, num_partitions)
    _paged_decode_attention_kernel[grid](
        q,
        kv_cache_layer,
        block_tables,
        seq_lens,
        out,
        scratch.max_logits,
        scratch.exp_sums,
        scratch.partial_out,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        block_tables.stride(0),
        num_partitions,
        NUM_KV_HEADS=num_kv_heads,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=max(next_power_of_two(queries_per_kv), _MIN_DOT_ROWS),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=min(partition_size, _MAX_BLOCK_N),
        PARTITION_SIZE=partition_size,
        SINGLE_PARTITION=num_partitions == 1,
        # fp32 caches get true fp32 products (tests hold them to 1e-4); tf32 would not.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_paged_decode_attention_kernel),
    )


def _launch_reduce(
    out: torch.Tensor,
    scratch: _Scratch,
    seq_lens: torch.Tensor,
    partition_size: int,
) -> None:
    num_seqs, num_heads, head_dim = out.shape
    _paged_decode_reduce_kernel[(num_seqs, num_heads)](
        out,
        scratch.max_logits,
        scratch.exp_sums,
        scratch.partial_out,
        seq_lens,
        out.stride(0),
        out.stride(1),
        scratch.num_partitions,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        PARTITION_SIZE=partition_size,
        PARTITIONS_POW2=next_power_of_two(scratch.num_partitions),
    )


def ref_paged_decode_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    partition_size: int = DEFAULT_PARTITION_SIZE,
) -> torch.Tensor:
    """Plain-PyTorch :func:`paged_decode_attention` (``partition_size`` is ignored).

    Gathers every sequence's context up to the batch's longest, so memory is
    ``S * max(seq_lens) * Hkv * D``: meant for tests and small CPU batches.
    """
    num_seqs, num_heads, _ = q.shape
    block_size, num_kv_heads = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    max_len = int(seq_lens.max()) if num_seqs else 0
    tables = block_tables[:, : triton.cdiv(max_len, block_size)].long()
    # (S, ctx, Hkv, D) -> (S, ctx, H, D): query head h reads kv head h // group.
    group = num_heads // num_kv_heads
    k = kv_cache_layer[0][tables].flatten(1, 2)[:, :max_len].repeat_interleave(group, dim=2)
    v = kv_cache_layer[1][tables].flatten(1, 2)[:, :max_len].repeat_interleave(group, dim=2)
    scores = torch.einsum("shd,slhd->shl", q.float(), k.float()) * scale
    positions = torch.arange(max_len, device=q.device)
    visible = positions[None, None, :] < seq_lens[:, None, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    probs = probs.nan_to_num(0.0)  # padded rows (seq_len 0) softmax over nothing -> zeros
    return torch.einsum("shl,slhd->shd", probs, v.float()).to(q.dtype)


def benchmark() -> None:
    """K/V bandwidth of a decode step, Llama-3-8B layer shapes, bf16, block 16."""
    device = cuda_or_explain("paged_decode_attention")
    if device is None:
        return
    for num_seqs, context in ((64, 4096), (16, 32768), (1, 131072)):
        _bench_case(num_seqs, context, device)


def _bench_case(num_seqs: int, context: int, device: torch.device) -> None:
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    blocks_per_seq = context // block_size
    num_blocks = num_seqs * blocks_per_seq
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(cache_shape, dtype=torch.bfloat16, device=device)
    # A shuffled block table: real caches are fragmented.
    perm = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    block_tables = perm.view(num_seqs, blocks_per_seq)
    seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    scale = head_dim**-0.5
    ms = bench_ms(
        lambda: paged_decode_attention(q, cache, block_tables, seq_lens, scale, max_seq_len=context)
    )
    # Every cached K and V element is read once; q, out and block tables are noise.
    nbytes = cache.numel() * cache.element_size() + 2 * q.numel() * q.element_size()
    label = f"paged_decode S={num_seqs:3d} ctx={context:6d} H={num_heads} Hkv={num_kv_heads}"
    report(label, ms, device, nbytes=nbytes)


if __name__ == "__main__":
    benchmark()
