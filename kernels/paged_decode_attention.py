"""Decode attention over the paged KV cache: one query token per sequence, split-K.

NOTE: a decode step has few queries (one per sequence) and long contexts, so parallelising over
(sequence, head) alone leaves most of the GPU idle. Flash-decoding splits each context into
partitions, one program per (sequence, kv head, split):

```
context of seq s:  |--- partition 0 ---|--- partition 1 ---|-- p2 --|   splits 3.. of s: no work
                           │                    │              │
                  (max, sum, acc) fp32  (max, sum, acc)  (max, sum, acc)   pass 1
                           └────────── log-sum-exp merge ──────┘           pass 2 -> out
```

The split count is chosen per launch (:func:`decode_plan`) from the batch alone, never from the
block-table width, so a CUDA graph of a batch size has one grid whatever its tables' width; each
row then cuts its own context into partitions of :func:`partition_len` tokens, so a short row
uses one program and a long one uses all of its splits. A program past its row's partitions
does nothing; a row that fits one partition is finished in pass 1 (normalised and written out,
no scratch), so scratch is written only by rows that really split, and pass 2 merges only
those, a chunk of partitions at a time.

A program serves all ``H // Hkv`` query heads that share its kv head (GQA), so each K/V tile is
read from HBM once per group, and the group's queries form the rows of one ``tl.dot``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    bench_ms,
    check,
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

_BLOCK_N = 64  # keys per inner tile
_SMALL_BLOCK_N = 16  # when 64-key partitions cannot fill the GPU (a batch of one or two rows)
_MIN_DOT_ROWS = 16  # tl.dot needs >= 16 rows; small GQA groups are padded up to it
_REDUCE_CHUNK = 16  # partitions pass 2 merges per vector step
TARGET_CTAS_PER_SM = 2
REFERENCE_NUM_SMS = 132  # H100 / H200 SXM: the plan off a GPU (tests, cross-compiles)
LONG_PARTITION = 1024  # a batch that fills the GPU splits only rows longer than this
MAX_LONG_SPLITS = 16  # ... into at most this many partitions
MAX_SPLITS = 256


class DecodePlan(NamedTuple):
    """How one launch splits its rows (see the module's NOTE).

    ``num_splits``: programs per (row, kv head), a power of two: grid axis 2.
    ``min_partition``: the shortest partition a row is cut into, tokens (a multiple of
    ``block_n``): a row no longer than it runs in one program and needs no pass 2.
    ``block_n``: keys per inner tile, and the granularity of partitions.
    """

    num_splits: int
    min_partition: int
    block_n: int

    def grid(self, num_seqs: int, num_kv_heads: int) -> tuple[int, int, int]:
        return (num_seqs, num_kv_heads, self.num_splits)


def decode_plan(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> DecodePlan:
    """The split of a launch of ``num_seqs`` rows whose contexts are at most ``max_seq_len``
    (a host-side bound: in a CUDA graph, the tables' width) on a GPU of ``num_sms`` SMs.

    Enough splits that ``TARGET_CTAS_PER_SM`` programs per SM have work when every row is as
    long as the bound; a batch already that wide splits only rows over ``LONG_PARTITION``
    tokens, into at most ``MAX_LONG_SPLITS``. The grid depends on the bound only below
    ``MAX_LONG_SPLITS * LONG_PARTITION`` tokens (and for tiny batches), so graph tables of any
    width give the same grid.
    """
    rows = max(num_seqs * num_kv_heads, 1)
    target = TARGET_CTAS_PER_SM * num_sms
    fill = next_power_of_two(triton.cdiv(target, rows))
    fits = rows * triton.cdiv(max_seq_len, _BLOCK_N) >= target
    block_n = _BLOCK_N if fits else _SMALL_BLOCK_N
    long = min(next_power_of_two(triton.cdiv(max_seq_len, LONG_PARTITION)), MAX_LONG_SPLITS)
    tiles = next_power_of_two(triton.cdiv(max_seq_len, block_n))
    splits = min(max(fill, long), tiles, MAX_SPLITS)
    return DecodePlan(splits, block_n if fill > 1 else LONG_PARTITION, block_n)


def partition_len(seq_len: int, plan: DecodePlan) -> int:
    """Tokens per partition of a row of ``seq_len`` (what ``_partition_len`` computes)."""
    per_split = triton.cdiv(triton.cdiv(seq_len, plan.num_splits), plan.block_n) * plan.block_n
    return max(per_split, plan.min_partition)


def partitions_of(seq_len: int, plan: DecodePlan) -> int:
    """Partitions (programs with keys, per kv head) of a row of ``seq_len``; 0 for padding."""
    return triton.cdiv(seq_len, partition_len(seq_len, plan))


@triton.jit
def _partition_len(seq_len, num_splits, min_partition, BLOCK_N: tl.constexpr):
    per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(per_split, min_partition)


# The block-table row stride and the plan change from step to step: specialised on (== 1, % 16)
# they would compile new variants mid-serving, for no gain. The int32 metadata sit at fixed
# offsets of the step's input buffers, aligned or not.
@triton.jit(
    do_not_specialize=["stride_bt_s", "num_splits", "min_partition"],
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
    num_splits,
    min_partition,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV padded to a tl.dot-friendly power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only, see tile_dot
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_len = _partition_len(seq_len, num_splits, min_partition, BLOCK_N)
    used = tl.cdiv(seq_len, part_len)
    # Programs past the row's partitions do nothing; program 0 of a padded row (seq_len 0)
    # writes its zeros.
    if part < tl.maximum(used, 1):
        start = part * part_len
        end = tl.minimum(start + part_len, seq_len)
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
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            valid = pos < end
            slot = paged_slots(
                block_tables_ptr, stride_bt_s, seq, pos, valid, stride_cache_block,
                BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
            )  # fmt: skip
            k = tl.load(k_base + slot[None, :] + dims[:, None], mask=valid[None, :], other=0.0).to(
                q.dtype
            )
            s = tile_dot(q, k, DOT_PRECISION, UPCAST) * qk_scale  # (GROUP_ROWS, BLOCK_N)
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slot[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(
                q.dtype
            )
            acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
            m_i = m_new

        if used <= 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            out_ptrs = out_ptr + seq * stride_out_s + heads[:, None] * stride_out_h + dims[None, :]
            tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])
        else:
            # Scratch is (S, H, splits) and (S, H, splits, D), fp32.
            idx = (seq * NUM_KV_HEADS * QUERIES_PER_KV + heads) * num_splits + part
            tl.store(max_logits_ptr + idx, m_i, mask=row_mask)
            tl.store(exp_sums_ptr + idx, l_i, mask=row_mask)
            acc_ptrs = partial_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :]
            tl.store(acc_ptrs, acc, mask=row_mask[:, None])


@triton.jit(
    do_not_specialize=["num_splits", "min_partition"],
    do_not_specialize_on_alignment=["seq_lens_ptr"],
)
def _paged_decode_reduce_kernel(
    out_ptr,
    max_logits_ptr,
    exp_sums_ptr,
    partial_out_ptr,
    seq_lens_ptr,
    stride_out_s,
    stride_out_h,
    num_splits,
    min_partition,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    used = tl.cdiv(seq_len, _partition_len(seq_len, num_splits, min_partition, BLOCK_N))
    # A row of one partition (or none) was finished by pass 1. Every partition of a split row
    # holds keys, so each chunk's max is finite and the sum positive.
    if used > 1:
        base = (seq * NUM_HEADS + head) * num_splits
        parts = tl.arange(0, CHUNK)
        dims = tl.arange(0, HEAD_DIM)
        m_run = float("-inf")
        denom = 0.0
        acc = tl.zeros([HEAD_DIM], tl.float32)
        for first in range(0, used, CHUNK):
            live = first + parts < used
            idx = base + first + parts
            m = tl.load(max_logits_ptr + idx, mask=live, other=float("-inf"))
            sums = tl.load(exp_sums_ptr + idx, mask=live, other=0.0)
            partial = tl.load(
                partial_out_ptr + idx[:, None] * HEAD_DIM + dims[None, :],
                mask=live[:, None],
                other=0.0,
            )  # (CHUNK, D)
            m_new = tl.maximum(m_run, tl.max(m, 0))
            alpha = tl.exp2(m_run - m_new)
            weights = tl.exp2(m - m_new)
            denom = denom * alpha + tl.sum(weights * sums, 0)
            acc = acc * alpha + tl.sum(weights[:, None] * partial, 0)
            m_run = m_new
        out_ptrs = out_ptr + seq * stride_out_s + head * stride_out_h + dims
        tl.store(out_ptrs, (acc / denom).to(out_ptr.dtype.element_ty))


def _check_args(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    plan: DecodePlan | None,
    out: torch.Tensor | None,
) -> None:
    check_paged_attention_args(q, kv_cache_layer, block_tables, seq_lens, out)
    check_shape("block_tables", block_tables, (q.shape[0], None))  # one query per sequence
    if plan is not None:
        check_power_of_two("plan.num_splits", plan.num_splits)
        check_power_of_two("plan.block_n", plan.block_n, minimum=16)
        check(
            plan.min_partition >= plan.block_n and plan.min_partition % plan.block_n == 0,
            f"plan.min_partition must be a multiple of plan.block_n, got {plan}",
        )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    plan: DecodePlan | None = None,
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
        max_seq_len: host-side bound on ``seq_lens`` the plan is chosen by; default
            ``max_blocks * bs``. Any row is attended whole whatever the bound (it only sizes
            the split). No device sync either way (CUDA-graph safe).
        plan: the split, default :func:`decode_plan` of this launch (tests force small ones).
        out: optional ``(S, H, D)`` destination, q's dtype, last dim dense.

    Returns:
        ``(S, H, D)`` in q's dtype (``out`` when given); fp32 softmax and accumulation.
    """
    _check_args(q, kv_cache_layer, block_tables, seq_lens, plan, out)
    check_runnable(_paged_decode_attention_kernel, q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    plan = plan or launch_plan(q, kv_cache_layer, block_tables, max_seq_len)
    scratch = _scratch(*q.shape[:2], plan.num_splits, q.shape[2], q.device)
    _launch_partitions(q, kv_cache_layer, block_tables, seq_lens, scale, plan, out, scratch)
    if plan.num_splits > 1:
        _launch_reduce(out, scratch, seq_lens, plan)
    return out


def launch_plan(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int | None = None,
) -> DecodePlan:
    """The plan :func:`paged_decode_attention` launches these arguments with."""
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * kv_cache_layer.shape[2]
    return decode_plan(q.shape[0], kv_cache_layer.shape[3], max_seq_len, num_sms(q.device))


def num_sms(device: torch.device) -> int:
    """SMs of a CUDA device; ``REFERENCE_NUM_SMS`` elsewhere."""
    if device.type != "cuda":
        return REFERENCE_NUM_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


class DecodeLaunchStats(NamedTuple):
    """What a launch does, from its plan and the rows' lengths (no kernel runs)."""

    programs: int  # pass 1's grid
    programs_with_keys: int
    scratch_programs: int  # programs that write scratch (rows split in several partitions)
    scratch_bytes: int  # pass 1's scratch writes
    kv_bytes: int  # K and V read (each visible key once per kv head)
    reduce_programs: int  # pass 2's grid (0: not launched)


def decode_launch_stats(
    seq_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    plan: DecodePlan,
) -> DecodeLaunchStats:
    """:class:`DecodeLaunchStats` of a launch of ``plan`` over rows of ``seq_lens``."""
    parts = [partitions_of(n, plan) for n in seq_lens]
    split = sum(p for p in parts if p > 1) * num_kv_heads
    per_program = (num_heads // num_kv_heads) * (head_dim + 2) * 4  # fp32 acc, max, sum
    return DecodeLaunchStats(
        programs=math.prod(plan.grid(len(seq_lens), num_kv_heads)),
        programs_with_keys=sum(parts) * num_kv_heads,
        scratch_programs=split,
        scratch_bytes=split * per_program,
        kv_bytes=2 * sum(seq_lens) * num_kv_heads * head_dim * dtype_bytes,
        reduce_programs=len(seq_lens) * num_heads if plan.num_splits > 1 else 0,
    )


def warmup_plans() -> list[DecodePlan]:
    """One plan per variant the engine can launch: both passes by ``block_n``."""
    return [DecodePlan(2, block_n, block_n) for block_n in (_SMALL_BLOCK_N, _BLOCK_N)]


class _Scratch(NamedTuple):
    """Pass 1's per-partition results, fp32: (S, H, splits), (S, H, splits), (S, H, splits, D)."""

    max_logits: torch.Tensor  # base-2 running max of the scaled logits
    exp_sums: torch.Tensor  # sum of exp2(logit - max)
    partial_out: torch.Tensor  # unnormalised sum of weights * V


def _scratch(
    num_seqs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> _Scratch:
    """Scratch for ``num_splits``; placeholders when it is 1 (every row fits one program)."""
    if num_splits == 1:
        # Never dereferenced: the single-partition kernel writes the output directly.
        placeholder = torch.empty(1, dtype=torch.float32, device=device)
        return _Scratch(placeholder, placeholder, placeholder)
    shape = (num_seqs, num_heads, num_splits)
    return _Scratch(
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty(shape, dtype=torch.float32, device=device),
        torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
    )


def _launch_partitions(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    plan: DecodePlan,
    out: torch.Tensor,
    scratch: _Scratch,
) -> None:
    num_seqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
    queries_per_kv = num_heads // num_kv_heads
    _paged_decode_attention_kernel[plan.grid(num_seqs, num_kv_heads)](
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
        plan.num_splits,
        plan.min_partition,
        NUM_KV_HEADS=num_kv_heads,
        QUERIES_PER_KV=queries_per_kv,
        GROUP_ROWS=max(next_power_of_two(queries_per_kv), _MIN_DOT_ROWS),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=plan.block_n,
        # fp32 caches get true fp32 products (tests hold them to 1e-4); tf32 would not.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_paged_decode_attention_kernel),
    )


def _launch_reduce(
    out: torch.Tensor, scratch: _Scratch, seq_lens: torch.Tensor, plan: DecodePlan
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
        plan.num_splits,
        plan.min_partition,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_N=plan.block_n,
        CHUNK=_REDUCE_CHUNK,
    )


def ref_paged_decode_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain-PyTorch :func:`paged_decode_attention`.

    Gathers every sequence's context up to the batch's longest, so memory is
    ``S * max(seq_lens) * Hkv * D``: meant for tests and small CPU batches.
    """
    num_seqs, num_heads, _ = q.shape
    block_size, num_kv_heads = kv_cache_layer.shape[2], kv_cache_layer.shape[3]
    max_len = int(seq_lens.max()) if num_seqs else 0
    tables = block_tables[:, : triton.cdiv(max_len, block_size)].long()
    # (S, ctx, Hkv, D) -> (S, ctx, H, D): query head h reads kv head h // group.
    group = num_heads // num_kv_heads
    k = kv_cache_layer[0][tables].flatten(1, 2)[:, :max_len].float().repeat_interleave(group, 2)
    v = kv_cache_layer[1][tables].flatten(1, 2)[:, :max_len].float().repeat_interleave(group, 2)
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
    for num_seqs, context in ((64, 4096), (16, 32768), (1, 131072), (1, 4096)):
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
