"""Causal attention of a flat batch of query chunks over the paged KV cache.

NOTE: the new tokens' K/V are already in the cache (``reshape_and_cache`` runs first), so one
kernel covers a fresh prompt, a later chunk of a chunked prefill, a prompt whose prefix came from
the prefix cache or the KV store, and a decode token (query_len == 1) in a mixed batch:

```
sequence s:  cached context (seq_len - query_len)    new queries (query_len)
             [ 0 ..................... c-1 ][ c ........ seq_len-1 ]
query i sits at position c + i and sees keys [0, c + i]
```

One program owns a q tile of one sequence and one kv head: ``BLOCK_M`` rows, each a (query, head)
pair of ``BLOCK_Q`` consecutive queries times the kv head's ``H // Hkv`` query heads (GQA packing,
as vLLM's unified Triton attention: each K/V tile is read once per group, not once per head).
It runs a flash-attention online softmax over BLOCK_N-key tiles, looking every key up through the
block table. Key tiles past the program's last query position are never visited (causality).
The grid is the flat list of the step's q tiles (:func:`prefill_tiles`, built on the host), so
no program is launched for a sequence's missing tiles, nor for sequences another kernel serves
(the attention backend sends decode rows to ``paged_decode_attention`` and, on CUDA, prompts with
no cached context to FlashAttention).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._common import (
    bench_ms,
    check,
    check_dtype,
    check_paged_attention_args,
    check_runnable,
    check_same_device,
    check_shape,
    cuda_or_explain,
    interpreted,
    next_power_of_two,
    paged_slots,
    report,
    tile_dot,
)

_MIN_BLOCK_M = 16  # tl.dot needs >= 16 rows
_MAX_BLOCK_M = 128  # one q tile of 128 rows: 8 warps, two warpgroups on sm_90
_BLOCK_N = 64


class PrefillPlan(NamedTuple):
    """The tiling of a launch: ``block_m`` rows per program, each row one (query, head) pair of
    ``block_q`` queries times ``group_rows`` heads of one kv head (GQA packing)."""

    block_m: int
    block_q: int  # queries per tile
    group_rows: int  # query heads per kv head, padded to a power of two
    num_warps: int


def prefill_plan(max_query_len: int, queries_per_kv: int) -> PrefillPlan:
    """Rows per program: the longest query times the padded GQA group, rounded up to a power of
    two in [16, 128], so a step runs one of four variants."""
    group_rows = next_power_of_two(queries_per_kv)
    check(group_rows <= _MAX_BLOCK_M, f"at most {_MAX_BLOCK_M} q heads per kv head")
    wanted = next_power_of_two(max_query_len) * group_rows
    block_m = min(max(wanted, _MIN_BLOCK_M, group_rows), _MAX_BLOCK_M)
    return PrefillPlan(block_m, block_m // group_rows, group_rows, 8 if block_m == 128 else 4)


def prefill_tiles(query_lens: Sequence[int], seqs: Iterable[int], block_q: int) -> list[int]:
    """The q tiles of ``seqs`` (indices into ``query_lens``), flat ``[seq, q_block, ...]``: one
    program per tile and kv head, every one with queries (the grid is ``(len // 2, Hkv)``)."""
    flat: list[int] = []
    for s in seqs:
        for q_block in range(triton.cdiv(query_lens[s], block_q)):
            flat += (s, q_block)
    return flat


# The block-table row stride is the step's widest table: not specialised (a new variant per
# width class mid-serving, for no gain), nor is the alignment of the int32 metadata.
@triton.jit(
    do_not_specialize=["stride_bt_s"],
    do_not_specialize_on_alignment=[
        "block_tables_ptr",
        "query_start_loc_ptr",
        "seq_lens_ptr",
        "tiles_ptr",
    ],
)
def _paged_prefill_attention_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    tiles_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_q_t,
    stride_q_h,
    stride_out_t,
    stride_out_h,
    stride_cache_kv,
    stride_cache_block,
    stride_bt_s,
    NUM_KV_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    GROUP_ROWS: tl.constexpr,  # QUERIES_PER_KV padded to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # BLOCK_M // GROUP_ROWS
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only, see tile_dot
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tiles_ptr + 2 * tile).to(tl.int64)
    q_block = tl.load(tiles_ptr + 2 * tile + 1)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row r is query q_block * BLOCK_Q + r // GROUP_ROWS of head r % GROUP_ROWS of the group:
    # the group's heads share every K/V tile.
    r = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + r // GROUP_ROWS
    in_group = r % GROUP_ROWS
    row_mask = (q_idx < query_len) & (in_group < QUERIES_PER_KV)
    heads = kv_head * QUERIES_PER_KV + in_group
    q_pos = context_len + q_idx
    tokens = (q_start + q_idx).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + tokens[:, None] * stride_q_t + heads[:, None] * stride_q_h + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None], other=0.0)  # (BLOCK_M, D)

    # Keys past the tile's last query are invisible to all its rows.
    kv_end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    k_base = cache_ptr + kv_head * HEAD_DIM
    v_base = k_base + stride_cache_kv
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        key_mask = pos < kv_end
        slot = paged_slots(
            block_tables_ptr, stride_bt_s, seq, pos, key_mask, stride_cache_block,
            BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM,
        )  # fmt: skip
        k = tl.load(k_base + slot[None, :] + dims[:, None], mask=key_mask[None, :], other=0.0).to(
            q.dtype
        )
        s = tile_dot(q, k, DOT_PRECISION, UPCAST) * qk_scale  # (BLOCK_M, BLOCK_N)
        # Key 0 is visible to every row, so no row is all -inf after the first tile.
        visible = key_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] + dims[None, :], mask=key_mask[:, None], other=0.0).to(
            q.dtype
        )
        acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = (
        out_ptr + tokens[:, None] * stride_out_t + heads[:, None] * stride_out_h + dims[None, :]
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _check_args(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    tiles: torch.Tensor | None,
    out: torch.Tensor | None,
) -> None:
    check_paged_attention_args(q, kv_cache_layer, block_tables, seq_lens, out)
    num_seqs = block_tables.shape[0]
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    check_dtype("query_start_loc", query_start_loc, (torch.int32,))
    check(query_start_loc.is_contiguous(), "query_start_loc must be contiguous")
    check_same_device(q=q, query_start_loc=query_start_loc)
    check(max_query_len >= 0, f"max_query_len must be >= 0, got {max_query_len}")
    if tiles is not None:
        check_shape("tiles", tiles, (None, 2))
        check_dtype("tiles", tiles, (torch.int32,))
        check(tiles.is_contiguous(), "tiles must be contiguous")
        check_same_device(q=q, tiles=tiles)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    tiles: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new query tokens over its cached context.

    Args:
        q: ``(T, H, D)``, the cache's dtype, last dim dense. Query head ``h`` reads kv head
            ``h // (H // Hkv)``.
        kv_cache_layer: ``(2, N, bs, Hkv, D)`` with ``(bs, Hkv, D)`` dense, already holding the
            new tokens' K/V; not modified. ``D`` a power of two >= 16, ``bs`` a power of two.
        block_tables: ``(S, max_blocks)`` int32; only the first ``cdiv(seq_lens[s], bs)``
            entries of a row are read.
        query_start_loc: ``(S+1,)`` int32, non-decreasing; sequence ``s`` owns query tokens
            ``[qsl[s], qsl[s+1])`` (an empty range is allowed).
        seq_lens: ``(S,)`` int32, context length after this step, ``>= query_len``.
        max_query_len: host-side ``max(query_len)`` of the tiled sequences: it picks
            :func:`prefill_plan`; a longer query would be cut short.
        scale: softmax scale, usually ``D ** -0.5``.
        tiles: ``(n, 2)`` int32, :func:`prefill_tiles` of the sequences to attend with the
            block_q of ``prefill_plan(max_query_len, H // Hkv)``; default every sequence, built
            from ``query_start_loc`` on the host (a device sync: the engine passes its own).
        out: optional ``(T, H, D)`` destination, q's dtype, last dim dense.

    Returns:
        ``(T, H, D)`` in q's dtype (``out`` when given); fp32 softmax and accumulation. Query
        token ``i`` of ``s`` sits at position ``seq_lens[s] - query_len + i`` and attends to
        positions ``[0, position]``. Rows of no tiled sequence are not written: zeros when the
        launcher allocates ``out``.
    """
    args = (q, kv_cache_layer, block_tables, query_start_loc, seq_lens, max_query_len)
    _check_args(*args, tiles, out)
    check_runnable(_paged_prefill_attention_kernel, q.device)
    out = torch.zeros_like(q, memory_format=torch.contiguous_format) if out is None else out
    num_heads = q.shape[1]
    _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    plan = prefill_plan(max_query_len, num_heads // num_kv_heads)
    if tiles is None:
        query_lens = torch.diff(query_start_loc).tolist()
        flat = prefill_tiles(query_lens, range(len(query_lens)), plan.block_q)
        tiles = torch.tensor(flat, dtype=torch.int32, device=q.device).view(-1, 2)
    if tiles.shape[0] == 0 or max_query_len == 0 or num_heads == 0:
        return out
    _paged_prefill_attention_kernel[(tiles.shape[0], num_kv_heads)](
        q,
        kv_cache_layer,
        block_tables,
        query_start_loc,
        seq_lens,
        tiles,
        out,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache_layer.stride(0),
        kv_cache_layer.stride(1),
        block_tables.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        QUERIES_PER_KV=num_heads // num_kv_heads,
        GROUP_ROWS=plan.group_rows,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=plan.block_m,
        BLOCK_Q=plan.block_q,
        BLOCK_N=_BLOCK_N,
        # fp32 caches get true fp32 products (tests hold them to 1e-4); tf32 would not.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_paged_prefill_attention_kernel),
        num_warps=plan.num_warps,
    )
    return out


class PrefillLaunchStats(NamedTuple):
    """What a launch does, from its tiles and the rows' lengths (no kernel runs)."""

    programs: int  # all of them have queries
    kv_bytes: int  # K and V read: each tile's visible keys, once per kv head


def prefill_launch_stats(
    tiles: Sequence[int],
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    plan: PrefillPlan,
) -> PrefillLaunchStats:
    """:class:`PrefillLaunchStats` of a launch over ``tiles`` (:func:`prefill_tiles`)."""
    keys = 0
    for seq, q_block in zip(tiles[::2], tiles[1::2], strict=True):
        context_len = seq_lens[seq] - query_lens[seq]
        keys += min(seq_lens[seq], context_len + (q_block + 1) * plan.block_q)
    programs = len(tiles) // 2 * num_kv_heads
    return PrefillLaunchStats(programs, 2 * keys * num_kv_heads * head_dim * dtype_bytes)


def ref_paged_prefill_attention(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
) -> torch.Tensor:
    """Plain-PyTorch :func:`paged_prefill_attention`, one sequence at a time.

    ``max_query_len`` is accepted for signature parity and not needed.
    """
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    block_size = kv_cache_layer.shape[2]
    for s, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_tables[s, : triton.cdiv(seq_len, block_size)].long()
        k = kv_cache_layer[0, blocks].flatten(0, 1)[:seq_len]  # (seq_len, Hkv, D)
        v = kv_cache_layer[1, blocks].flatten(0, 1)[:seq_len]
        begin, end = starts[s], starts[s + 1]
        out[begin:end] = _causal_attention(q[begin:end], k, v, scale)
    return out


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q ``(n, H, D)`` are the last ``n`` positions of a context k, v ``(L, Hkv, D)``."""
    num_queries, num_heads, _ = q.shape
    context_len = k.shape[0]
    group = num_heads // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # (L, H, D)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    q_pos = context_len - num_queries + torch.arange(num_queries, device=q.device)
    k_pos = torch.arange(context_len, device=q.device)
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).to(q.dtype)


def benchmark() -> None:
    """Throughput of a prefill step, Llama-3-8B layer shapes, bf16, block 16."""
    device = cuda_or_explain("paged_prefill_attention")
    if device is None:
        return
    num_heads, num_kv_heads, head_dim, block_size = 32, 8, 128, 16
    # (sequences, new tokens each, cached context each): fresh prompts and a late prefill chunk.
    for num_seqs, query_len, cached in ((4, 2048, 0), (1, 8192, 0), (2, 2048, 14336)):
        _bench_case(
            num_seqs, query_len, cached, num_heads, num_kv_heads, head_dim, block_size, device
        )


def _bench_case(
    num_seqs: int,
    query_len: int,
    cached: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
) -> None:
    seq_len = cached + query_len
    blocks_per_seq = triton.cdiv(seq_len, block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.randn(
        2, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16, device=device
    )
    perm = torch.randperm(num_blocks, device=device, dtype=torch.int32)
    block_tables = perm.view(num_seqs, blocks_per_seq)
    qsl = torch.arange(0, num_seqs + 1, device=device, dtype=torch.int32) * query_len
    seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn(num_seqs * query_len, num_heads, head_dim, dtype=torch.bfloat16, device=device)
    ms = bench_ms(
        lambda: paged_prefill_attention(
            q, cache, block_tables, qsl, seq_lens, query_len, head_dim**-0.5
        )
    )
    # Two matmuls (QK^T, PV) of 2 flops per multiply-add over the causally visible pairs.
    visible_pairs = query_len * cached + query_len * (query_len + 1) // 2
    flops = 4 * num_seqs * num_heads * head_dim * visible_pairs
    report(
        f"paged_prefill S={num_seqs} q={query_len:5d} cached={cached:5d}", ms, device, flops=flops
    )


if __name__ == "__main__":
    benchmark()
