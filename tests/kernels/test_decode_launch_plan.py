"""The decode kernel's launch plan: the grid follows the batch, not the block-table width, and
only programs with keys write scratch.

:func:`decode_launch_stats` counts what a launch does from the same plan the launcher uses
(:func:`launch_plan`); ``test_kernel_writes_the_scratch_the_plan_says`` ties that count to the
kernel itself under the interpreter.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch

from kernels.paged_decode_attention import (
    DecodePlan,
    decode_launch_stats,
    launch_plan,
    partitions_of,
    ref_paged_decode_attention,
)

# The module, not the package's attribute of the same name (the launcher).
decode = importlib.import_module("kernels.paged_decode_attention")
BLOCK_SIZE = 16


def _plan_of(num_seqs: int, num_heads: int, num_kv_heads: int, width_tokens: int) -> DecodePlan:
    """The launcher's plan for a batch whose tables are ``width_tokens`` wide (meta tensors)."""
    meta = {"device": "meta"}
    q = torch.empty(num_seqs, num_heads, 128, dtype=torch.bfloat16, **meta)
    cache = torch.empty(2, 1, BLOCK_SIZE, num_kv_heads, 128, dtype=torch.bfloat16, **meta)
    tables = torch.empty(num_seqs, width_tokens // BLOCK_SIZE, dtype=torch.int32, **meta)
    return launch_plan(q, cache, tables)


def test_one_long_row_among_short_ones_writes_no_dead_scratch() -> None:
    # Llama-3-8B shapes; 255 rows of 500 tokens and one of 128k, tables 128k wide.
    seq_lens = [500] * 255 + [131072]
    plan = _plan_of(256, 32, 8, 131072)
    stats = decode_launch_stats(seq_lens, 32, 8, 128, 2, plan)
    # Before: 256 partitions of 512 per row, 524,288 programs, 34.6 GB of scratch written by
    # programs with no key.
    assert stats.programs == 256 * 8 * 16
    # Short rows: one program each, finished in pass 1; the long row: 16 partitions of 8k.
    assert stats.programs_with_keys == 255 * 8 + 16 * 8
    assert stats.scratch_programs == 16 * 8  # only the long row's programs, all with keys
    assert stats.scratch_bytes == 16 * 32 * (128 + 2) * 4


def test_graph_grid_does_not_grow_with_the_table_width() -> None:
    widths = [16384, 32768, 131072, 1 << 20]  # graph tables of max_model_len
    grids = {_plan_of(batch, 32, 8, w).grid(batch, 8) for batch in (64,) for w in widths}
    assert grids == {(64, 8, 16)}
    # A batch that fills the GPU alone, over short contexts, runs one program per row.
    assert _plan_of(256, 32, 8, 8192).grid(256, 8) == (256, 8, 8)
    stats = decode_launch_stats([300] * 256, 32, 8, 128, 2, _plan_of(256, 32, 8, 8192))
    assert stats.programs_with_keys == 256 * 8 and stats.scratch_bytes == 0


def test_small_batches_fill_the_sms() -> None:
    # Llama-3-70B at TP 8: 8 q heads and 1 kv head per rank; batch 1, 4k context.
    plan = _plan_of(1, 8, 1, 4096)
    stats = decode_launch_stats([4096], 8, 1, 128, 2, plan)
    assert stats.programs_with_keys == 256  # was 8 (partitions of 512)
    # Llama-3-8B, batch 4 x 2k: every program has keys and there are ~2 per SM.
    stats = decode_launch_stats([2048] * 4, 32, 8, 128, 2, _plan_of(4, 32, 8, 2048))
    assert stats.programs_with_keys == stats.programs >= 2 * 132


@pytest.mark.parametrize(
    "plan",
    [DecodePlan(4, 16, 16), DecodePlan(8, 32, 16), DecodePlan(2, 64, 64)],
    ids=lambda p: f"splits{p.num_splits}-min{p.min_partition}-n{p.block_n}",
)
def test_kernel_writes_the_scratch_the_plan_says(
    plan: DecodePlan,
    paged_context: Callable,
    monkeypatch: pytest.MonkeyPatch,
    device: torch.device,
) -> None:
    seq_lens = [0, 1, 15, 16, 17, 64, 100, 300]
    num_heads, num_kv_heads = 4, 2
    ctx = paged_context(seq_lens, BLOCK_SIZE, num_kv_heads, 32, torch.float32)
    scratches = []

    def nan_scratch(*args: object) -> decode._Scratch:
        s = decode._Scratch(*(t.fill_(float("nan")) for t in real_scratch(*args)))
        scratches.append(s)
        return s

    real_scratch = decode._scratch
    monkeypatch.setattr(decode, "_scratch", nan_scratch)
    q = torch.randn(len(seq_lens), num_heads, 32, device=device)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 32**-0.5)
    out = decode.paged_decode_attention(*args, plan=plan)
    torch.testing.assert_close(out, ref_paged_decode_attention(*args), atol=1e-4, rtol=1e-4)

    written = ~scratches[0].exp_sums.isnan()  # (S, H, splits)
    for s, n in enumerate(seq_lens):
        parts = partitions_of(n, plan)
        expected = torch.zeros(plan.num_splits, dtype=torch.bool)
        expected[:parts] = parts > 1
        assert torch.equal(written[s].cpu(), expected.expand(num_heads, -1)), (s, n)
    stats = decode_launch_stats(seq_lens, num_heads, num_kv_heads, 32, 4, plan)
    assert written.sum() == stats.scratch_programs * (num_heads // num_kv_heads)
