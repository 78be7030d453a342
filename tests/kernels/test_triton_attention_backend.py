"""The Triton attention backend by row kind: which kernel serves which rows of a mixed step
(``common.attention_plan``: :func:`step_launch`, counted by :func:`launch_stats`), and its
results against the torch reference backend under the interpreter."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch

import common.attention as attention
from common.attention import AttentionMetadata, TorchAttentionBackend, TritonAttentionBackend
from common.attention_plan import RowTensors, launch_stats, step_launch, upload
from kernels.paged_decode_attention import decode_launch_stats, decode_plan

SMS = 132


def _host_meta(query_lens: list[int], seq_lens: list[int]) -> AttentionMetadata:
    """Host lists only: what the launch plan reads."""
    empty = torch.empty(0, dtype=torch.int32)
    return AttentionMetadata(
        empty, empty, empty.view(0, 0), empty.long(), query_lens, seq_lens,
        max(query_lens), max(seq_lens),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cached", "flash"),
    [(2048, True), (0, False), (0, True)],
    ids=["chunk-after-prefix", "fresh-chunk-triton", "fresh-chunk-flash"],
)
def test_mixed_step_sends_decode_rows_to_the_decode_kernel(cached: int, flash: bool) -> None:
    # Llama-3-8B: 32 q heads, 8 kv heads, head 128, bf16; 200 decodes x 1000 + an 1848 chunk.
    query_lens = [1] * 200 + [1848]
    seq_lens = [1000] * 200 + [cached + 1848]
    meta = _host_meta(query_lens, seq_lens)
    launch = step_launch(meta, 32, 8, flash, SMS)
    stats = launch_stats(launch, meta, 32, 8, 128, 2)
    # Before: one prefill launch over all 201 rows, 186,528 programs, 3.9% with work.
    assert stats.programs_with_work >= 0.5 * stats.programs
    alone = decode_launch_stats([1000] * 200, 32, 8, 128, 2, decode_plan(200, 8, 1000, SMS))
    assert stats.decode_kv_bytes == alone.kv_bytes == 200 * 8 * 1000 * 128 * 2 * 2
    assert launch.decode_rows == list(range(200))
    assert launch.flash_rows == ([200] if flash and not cached else [])
    # The chunk's tiles: 1848 queries x 4 heads of a group in 128-row tiles, per kv head.
    assert stats.programs - alone.programs == (0 if launch.flash_rows else 58 * 8)


# (cached context, query_len): decode tokens, a one-token prompt, a fresh prompt, chunks after
# a prefix (one of several q tiles), a sequence with no query this step.
MIXED = [(15, 1), (0, 1), (0, 37), (45, 20), (100, 1), (13, 70), (30, 0), (200, 1)]


def _mixed(
    paged_context: Callable, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    seq_lens = [c + q for c, q in MIXED]
    query_lens = [q for _, q in MIXED]
    ctx = paged_context(seq_lens, 16, num_kv_heads, 64, dtype)
    q = torch.randn(sum(query_lens), num_heads, 64, device=device).to(dtype)
    qsl = torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(
        qsl, ctx.seq_lens, ctx.block_tables, torch.zeros(0, dtype=torch.int64, device=device),
        query_lens, seq_lens, max(query_lens), max(seq_lens),
    )  # fmt: skip
    return q, ctx.kv_cache_layer, meta


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads"),
    [(torch.float32, 8, 2), (torch.bfloat16, 4, 4), (torch.float32, 6, 2)],
    ids=["fp32-gqa4", "bf16-mha", "fp32-gqa3"],
)
def test_mixed_batch_matches_the_reference(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    paged_context: Callable,
    assert_close: Callable,
    device: torch.device,
) -> None:
    q, kv_layer, meta = _mixed(paged_context, num_heads, num_kv_heads, dtype, device)
    out = TritonAttentionBackend().attend(q, kv_layer, meta, 0.125)
    launch, _ = meta.step_cache["triton"]
    assert launch.decode_rows == [0, 1, 4, 7] and launch.prefill_rows == [2, 3, 5]
    assert_close(out, TorchAttentionBackend().attend(q, kv_layer, meta, 0.125))


@pytest.mark.parametrize("takes_gqa", [True, False], ids=["torch>=2.12", "torch-2.11"])
def test_fresh_prompts_go_to_flash_attention(
    paged_context: Callable,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
    takes_gqa: bool,
) -> None:
    """The FlashAttention path's plumbing (K/V gathered by slot, packed rows, GQA, causal), with
    torch's varlen kernel (CUDA only) replaced by per-sequence SDPA of the same contract. torch
    2.11's form takes no ``enable_gqa`` and wants as many K/V heads as query heads (what the
    H200 run of 2026-11-28 found: torch 2.11 refused the keyword)."""
    calls = []

    def attend(q, k, v, cu_q, cu_k, window_size, enable_gqa):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k)
        assert enable_gqa or k.shape[1] == q.shape[1]
        calls.append(cu_q.tolist())
        out = torch.empty_like(q)
        for lo, hi in itertools.pairwise(cu_q.tolist()):
            o = torch.nn.functional.scaled_dot_product_attention(
                q[lo:hi].transpose(0, 1), k[lo:hi].transpose(0, 1), v[lo:hi].transpose(0, 1),
                is_causal=True, scale=scale_of[0], enable_gqa=enable_gqa,
            )  # fmt: skip
            out[lo:hi] = o.transpose(0, 1)
        return out

    scale_of = [None]

    def varlen_gqa(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size, enable_gqa=False):
        scale_of[0] = scale
        return attend(q, k, v, cu_q, cu_k, window_size, enable_gqa)

    def varlen_211(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale, window_size):
        scale_of[0] = scale
        return attend(q, k, v, cu_q, cu_k, window_size, False)

    monkeypatch.setattr(attention, "varlen_attn", varlen_gqa if takes_gqa else varlen_211)
    q, kv_layer, meta = _mixed(paged_context, 8, 2, torch.float32, device)
    out = TritonAttentionBackend(flash=True).attend(q, kv_layer, meta, 0.125)
    assert calls == [[0, 37]]  # the one fresh prompt; the chunks keep the Triton kernel
    expected = TorchAttentionBackend().attend(q, kv_layer, meta, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_a_mixed_steps_row_indices_reach_the_device_in_one_copy(
    paged_context: Callable, device: torch.device
) -> None:
    """Every index list of a mixed step leaves the host in one buffer (pinned and asynchronous
    on CUDA). Reading the code after the H200 run of 2026-11-28 (mixed step 1.74x) found them
    built with seven blocking copies, each holding the host until the queued GPU work had run."""
    _, _, meta = _mixed(paged_context, 8, 2, torch.float32, device)
    launch = step_launch(meta, 8, 2, True, 132)
    rows = RowTensors.build(launch, meta, 16)
    uploaded = (rows.decode_tokens, rows.flash_tokens)
    assert len({t.untyped_storage().data_ptr() for t in uploaded}) == 1
    assert rows.decode_tokens.tolist() == [meta.query_starts_cpu[i] for i in launch.decode_rows]
    assert rows.flash_cu_seqlens.dtype == rows.tiles.dtype == torch.int32
    assert rows.flash_cu_seqlens.tolist() == [0, 37]
    assert rows.tiles.shape == (len(launch.tiles) // 2, 2)
    parts = upload([np.arange(3), np.zeros(0, np.int64), np.array([7, 8])], device)
    assert [p.tolist() for p in parts] == [[0, 1, 2], [], [7, 8]]
