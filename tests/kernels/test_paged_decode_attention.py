"""paged_decode_attention against its reference; the reference against SDPA on unpaged K/V.

Tolerances (atol, rtol) are in conftest.TOLERANCES: fp32 1e-4, fp16/bf16 2e-2. Small forced
plans make short contexts span several split-K partitions, so the merge pass is exercised cheaply.
The launch plan (:func:`decode_plan`, :func:`decode_launch_stats`) is checked in
``test_decode_launch_plan.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.paged_decode_attention import (
    DecodePlan,
    paged_decode_attention,
    ref_paged_decode_attention,
)

CASES = [  # (dtype, block_size, head_dim, num_heads, num_kv_heads, partition_size)
    # partition_size: the forced plan's shortest partition (and tile); 4 splits per row
    pytest.param(torch.float32, 16, 64, 4, 4, 32, id="fp32-bs16-d64-gqa1"),
    pytest.param(torch.float32, 32, 128, 8, 2, 64, id="fp32-bs32-d128-gqa4"),
    pytest.param(torch.bfloat16, 16, 128, 8, 1, 32, id="bf16-bs16-d128-gqa8"),
    pytest.param(torch.float16, 32, 64, 4, 1, 32, id="fp16-bs32-d64-gqa4"),
]


def _plan(partition_size: int, num_splits: int = 4) -> DecodePlan:
    return DecodePlan(num_splits, partition_size, min(partition_size, 64))


def _seq_lens(block_size: int, partition_size: int) -> list[int]:
    # One token, exactly one block, a ragged length, several partitions plus a ragged tail, a
    # padded row, and a row long enough that its partitions outgrow the shortest one.
    return [1, block_size, 37, 3 * partition_size + 5, 0, 9 * partition_size + 3]


@pytest.mark.parametrize(
    ("dtype", "block_size", "head_dim", "num_heads", "num_kv_heads", "partition_size"), CASES
)
def test_matches_ref(
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    partition_size: int,
    paged_context: Callable,
    assert_close: Callable,
    device: torch.device,
) -> None:
    ctx = paged_context(
        _seq_lens(block_size, partition_size), block_size, num_kv_heads, head_dim, dtype
    )
    q = torch.randn(len(ctx.keys), num_heads, head_dim, device=device).to(dtype)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, head_dim**-0.5)
    out = paged_decode_attention(*args, plan=_plan(partition_size))
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref_paged_decode_attention(*args))


def test_single_partition_path_and_max_seq_len(
    paged_context: Callable, assert_close: Callable, device: torch.device
) -> None:
    ctx = paged_context([5, 16, 70], 16, 2, 64, torch.bfloat16)
    q = torch.randn(3, 4, 64, device=device).to(torch.bfloat16)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.125)
    expected = ref_paged_decode_attention(*args)
    # Every context fits one partition: the first pass writes the output, no merge.
    assert_close(paged_decode_attention(*args), expected)
    # Split rows merged by pass 2 give the same result.
    assert_close(paged_decode_attention(*args, plan=_plan(16)), expected)
    # A bound below the longest row only changes the split: every row is still attended whole.
    assert_close(paged_decode_attention(*args, max_seq_len=16), expected)


def test_padded_rows_give_zeros(paged_context: Callable, device: torch.device) -> None:
    ctx = paged_context([33, 0, 9], 16, 1, 64, torch.float32)
    q = torch.randn(3, 2, 64, device=device)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.125)
    for partition_size in (16, 512):  # both the merge path and the single-partition path
        out = paged_decode_attention(*args, plan=_plan(partition_size))
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out, ref_paged_decode_attention(*args), atol=1e-4, rtol=1e-4)


def test_strided_q_and_out(paged_context: Callable, device: torch.device) -> None:
    num_heads, num_kv_heads, head_dim = 4, 2, 64
    ctx = paged_context([20, 41], 16, num_kv_heads, head_dim, torch.float32)
    qkv = torch.randn(2, num_heads + 2 * num_kv_heads, head_dim, device=device)
    q = qkv[:, :num_heads]  # a slice of a fused projection: token stride 8 * D
    out = torch.zeros(2, num_heads, 2 * head_dim, device=device)[..., :head_dim]
    args = (q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.125)
    result = paged_decode_attention(*args, plan=_plan(16), out=out)
    assert result is out
    torch.testing.assert_close(out, ref_paged_decode_attention(*args), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_ref_matches_sdpa_on_unpaged_kv(
    num_heads: int,
    num_kv_heads: int,
    paged_context: Callable,
    oracle: Callable,
    device: torch.device,
) -> None:
    ctx = paged_context([1, 16, 50], 16, num_kv_heads, 64, torch.float32)
    q = torch.randn(3, num_heads, 64, device=device)
    out = ref_paged_decode_attention(q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.3)
    for s, (k, v) in enumerate(zip(ctx.keys, ctx.values, strict=True)):
        expected = oracle(q[s : s + 1], k, v, 0.3)[0]
        torch.testing.assert_close(out[s], expected, atol=1e-5, rtol=1e-5)


BAD_ARGUMENTS = [
    ({"q": lambda t: t.half()}, "q must have dtype"),
    ({"block_tables": lambda t: t.long()}, "block_tables must have dtype"),
    ({"seq_lens": lambda t: t.long()}, "seq_lens must have dtype"),
    ({"seq_lens": lambda t: t[:1]}, "seq_lens must have shape"),
    ({"q": lambda t: t[:, :3]}, "multiple of kv heads"),
    ({"q": lambda t: t[..., :32]}, "q must have shape"),
    ({"kv_cache_layer": lambda t: t[:1]}, "kv_cache_layer must have shape"),
    ({"plan": lambda _: DecodePlan(3, 64, 64)}, "num_splits must be a power of two"),
    ({"plan": lambda _: DecodePlan(4, 40, 16)}, "min_partition must be a multiple"),
    ({"block_tables": lambda t: t.t().contiguous().t()}, "block_tables must be contiguous"),
]


@pytest.mark.parametrize(("change", "message"), BAD_ARGUMENTS)
def test_rejects_bad_arguments(
    change: dict, message: str, paged_context: Callable, device: torch.device
) -> None:
    ctx = paged_context([3, 17], 16, 2, 64, torch.float32)
    args = {
        "q": torch.randn(2, 4, 64, device=device),
        "kv_cache_layer": ctx.kv_cache_layer,
        "block_tables": ctx.block_tables,
        "seq_lens": ctx.seq_lens,
        "scale": 0.125,
        "plan": _plan(32),
    }
    for name, transform in change.items():
        args[name] = transform(args[name])
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**args)


def test_rejects_non_power_of_two_head_dim(device: torch.device) -> None:
    cache = torch.zeros(2, 4, 16, 1, 80, device=device)
    q = torch.zeros(1, 1, 80, device=device)
    tables = torch.zeros(1, 4, dtype=torch.int32, device=device)
    seq_lens = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="head_dim must be a power of two"):
        paged_decode_attention(q, cache, tables, seq_lens, 0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    # From the module: the package attribute of the same name is the launcher.
    from kernels.paged_decode_attention import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
