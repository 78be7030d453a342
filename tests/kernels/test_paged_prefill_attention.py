"""paged_prefill_attention against its reference; the reference against SDPA on unpaged K/V.

Tolerances (atol, rtol) are in conftest.TOLERANCES: fp32 1e-4, fp16/bf16 2e-2. Each batch
mixes a fresh prompt, a chunk after a cached prefix, decode tokens (query_len 1) and an empty
sequence, the shapes chunked prefill and prefix-cache hits produce.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.paged_decode_attention import DecodePlan, paged_decode_attention
from kernels.paged_prefill_attention import (
    paged_prefill_attention,
    prefill_plan,
    prefill_tiles,
    ref_paged_prefill_attention,
)

CASES = [  # (dtype, block_size, head_dim, num_heads, num_kv_heads)
    pytest.param(torch.float32, 16, 64, 2, 2, id="fp32-bs16-d64-gqa1"),
    pytest.param(torch.float32, 32, 128, 4, 1, id="fp32-bs32-d128-gqa4"),
    pytest.param(torch.bfloat16, 16, 128, 8, 1, id="bf16-bs16-d128-gqa8"),
    pytest.param(torch.float16, 32, 64, 4, 1, id="fp16-bs32-d64-gqa4"),
    pytest.param(torch.float32, 16, 64, 6, 2, id="fp32-bs16-d64-gqa3"),  # group padded to 4
]


def _batch(block_size: int) -> tuple[list[int], list[int]]:
    """(cached context, query_len) per sequence -> (seq_lens, query_lens)."""
    shapes = [
        (0, 37),  # fresh prompt, ragged
        (block_size, 1),  # decode token right after a block boundary
        (45, 20),  # chunk after a prefix-cache hit, crossing blocks
        (0, 1),  # a one-token prompt: seq_len 1
        (70, 0),  # a sequence with no query this step
        (block_size - 3, 70),  # several q tiles (BLOCK_M 128)
    ]
    return [c + q for c, q in shapes], [q for _, q in shapes]


def _query_start_loc(query_lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *query_lens], device=device).cumsum(0).to(torch.int32)


@pytest.mark.parametrize(("dtype", "block_size", "head_dim", "num_heads", "num_kv_heads"), CASES)
def test_matches_ref(
    dtype: torch.dtype,
    block_size: int,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    paged_context: Callable,
    assert_close: Callable,
    device: torch.device,
) -> None:
    seq_lens, query_lens = _batch(block_size)
    ctx = paged_context(seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = torch.randn(sum(query_lens), num_heads, head_dim, device=device).to(dtype)
    qsl = _query_start_loc(query_lens, device)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, qsl, ctx.seq_lens, max(query_lens))
    out = paged_prefill_attention(*args, head_dim**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref_paged_prefill_attention(*args, head_dim**-0.5))


def test_explicit_tiles_attend_only_their_sequences(
    paged_context: Callable, device: torch.device
) -> None:
    seq_lens, query_lens = _batch(16)
    ctx = paged_context(seq_lens, 16, 2, 64, torch.float32)
    q = torch.randn(sum(query_lens), 8, 64, device=device)
    qsl = _query_start_loc(query_lens, device)
    chosen = [0, 2]  # the fresh prompt and the chunk after a prefix
    longest = max(query_lens[s] for s in chosen)
    flat = prefill_tiles(query_lens, chosen, prefill_plan(longest, 4).block_q)
    tiles = torch.tensor(flat, dtype=torch.int32, device=device).view(-1, 2)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, qsl, ctx.seq_lens)
    out = paged_prefill_attention(*args, longest, 0.125, tiles=tiles)
    expected = ref_paged_prefill_attention(*args, longest, 0.125)
    starts = qsl.tolist()
    for s in range(len(seq_lens)):
        rows = slice(starts[s], starts[s + 1])
        want = expected[rows] if s in chosen else torch.zeros_like(out[rows])
        torch.testing.assert_close(out[rows], want, atol=1e-4, rtol=1e-4)


def test_decode_only_batch_matches_decode_kernel(
    paged_context: Callable, device: torch.device
) -> None:
    ctx = paged_context([1, 16, 17, 90], 16, 2, 64, torch.float32)
    q = torch.randn(4, 8, 64, device=device)
    qsl = torch.arange(5, dtype=torch.int32, device=device)
    prefill = paged_prefill_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, qsl, ctx.seq_lens, 1, 0.125
    )
    decode = paged_decode_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, ctx.seq_lens, 0.125, plan=DecodePlan(4, 32, 32)
    )
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


def test_strided_q_out_and_unowned_rows(paged_context: Callable, device: torch.device) -> None:
    ctx = paged_context([30, 12], 16, 1, 64, torch.float32)
    qkv = torch.randn(25, 4, 64, device=device)
    q = qkv[:, :2]  # fused-projection slice; rows 24.. belong to no sequence (padding)
    qsl = torch.tensor([0, 18, 24], dtype=torch.int32, device=device)
    args = (q, ctx.kv_cache_layer, ctx.block_tables, qsl, ctx.seq_lens, 18, 0.125)
    out = paged_prefill_attention(*args)
    torch.testing.assert_close(out, ref_paged_prefill_attention(*args), atol=1e-4, rtol=1e-4)
    assert torch.equal(out[24], torch.zeros_like(out[24]))
    preallocated = torch.full((25, 2, 128), 7.0, device=device)[..., :64]
    assert paged_prefill_attention(*args, out=preallocated) is preallocated
    torch.testing.assert_close(preallocated[:24], out[:24])
    assert (preallocated[24] == 7.0).all()


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2)])
def test_ref_matches_sdpa_on_unpaged_kv(
    num_heads: int,
    num_kv_heads: int,
    paged_context: Callable,
    oracle: Callable,
    device: torch.device,
) -> None:
    seq_lens, query_lens = _batch(16)
    ctx = paged_context(seq_lens, 16, num_kv_heads, 64, torch.float32)
    q = torch.randn(sum(query_lens), num_heads, 64, device=device)
    qsl = _query_start_loc(query_lens, device)
    out = ref_paged_prefill_attention(
        q, ctx.kv_cache_layer, ctx.block_tables, qsl, ctx.seq_lens, max(query_lens), 0.3
    )
    starts = qsl.tolist()
    for s, (k, v) in enumerate(zip(ctx.keys, ctx.values, strict=True)):
        rows = slice(starts[s], starts[s + 1])
        torch.testing.assert_close(out[rows], oracle(q[rows], k, v, 0.3), atol=1e-5, rtol=1e-5)


BAD_ARGUMENTS = [
    ({"q": lambda t: t.bfloat16()}, "q must have dtype"),
    ({"query_start_loc": lambda t: t.long()}, "query_start_loc must have dtype"),
    ({"query_start_loc": lambda t: t[:-1]}, "query_start_loc must have shape"),
    ({"block_tables": lambda t: t.long()}, "block_tables must have dtype"),
    ({"seq_lens": lambda t: t[:1]}, "seq_lens must have shape"),
    ({"q": lambda t: t[:, :3]}, "multiple of kv heads"),
    ({"q": lambda t: t.transpose(0, 2).contiguous().transpose(0, 2)}, "q must be contiguous"),
    ({"max_query_len": lambda _: -1}, "max_query_len must be >= 0"),
]


@pytest.mark.parametrize(("change", "message"), BAD_ARGUMENTS)
def test_rejects_bad_arguments(
    change: dict, message: str, paged_context: Callable, device: torch.device
) -> None:
    ctx = paged_context([3, 17], 16, 2, 64, torch.float32)
    args = {
        "q": torch.randn(5, 4, 64, device=device),
        "kv_cache_layer": ctx.kv_cache_layer,
        "block_tables": ctx.block_tables,
        "query_start_loc": torch.tensor([0, 3, 5], dtype=torch.int32, device=device),
        "seq_lens": ctx.seq_lens,
        "max_query_len": 3,
        "scale": 0.125,
    }
    for name, transform in change.items():
        args[name] = transform(args[name])
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    # From the module: the package attribute of the same name is the launcher.
    from kernels.paged_prefill_attention import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
