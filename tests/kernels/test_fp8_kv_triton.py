"""The FP8 KV cache (``--kv-cache-dtype fp8``) in the Triton kernels, on CPU through the
interpreter: the rotary op writes each K/V value as torch's e4m3 conversion of what it writes
into a cache of the model dtype (nearest even, saturating to +-448); the decode and prefill
kernels read FP8 rows widened to the queries' dtype, so attending over an FP8 cache is exactly
attending over that cache widened first (e4m3 values are exact in bf16 and fp32)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton
import triton.language as tl

from kernels.paged_decode_attention import DecodePlan, paged_decode_attention
from kernels.paged_prefill_attention import paged_prefill_attention
from kernels.rotary import _to_cache, ref_rotary_embedding_and_cache, rotary_embedding_and_cache
from tests.kernels.test_rotary import rotary_inputs

FP8 = torch.float8_e4m3fn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@triton.jit
def _convert_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n)
    tl.store(dst_ptr + offs, _to_cache(x, dst_ptr.dtype.element_ty), mask=offs < n)


def test_the_kernels_fp8_write_is_torchs_conversion(device) -> None:
    """Every bf16 value (as fp32; NaNs aside), ties, subnormals, both zeros and values past the
    range: the bytes the rotary op writes are torch's ``.to(float8_e4m3fn)``, bit for bit."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    x = patterns.view(torch.bfloat16).float()
    ties = torch.tensor([1.0625, 1.1875, 2**-10, 3 * 2**-10, 464.0, 480.0, -0.0, 1e30, -1e-30])
    x = torch.cat([x[~x.isnan()], ties, torch.randn(4096) * 100]).to(device)
    out = torch.empty(x.shape, dtype=FP8, device=device)
    _convert_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    assert torch.equal(_bytes(out), _bytes(x.to(FP8)))


@pytest.mark.parametrize("scale", [1.0, 300.0], ids=["in-range", "saturating"])
def test_rotary_writes_the_e4m3_of_the_model_dtype_value(scale: float, device) -> None:
    args = rotary_inputs(torch.float32, 16, 8, 2, 64, device)
    args = args._replace(qkv=args.qkv * scale)  # 300 x N(0, 2): many values past 448
    wide = args.kv_cache_layer.clone()
    expected_q = ref_rotary_embedding_and_cache(*args._replace(kv_cache_layer=wide))
    fp8 = args.kv_cache_layer.to(FP8)
    untouched = fp8.clone()
    q = rotary_embedding_and_cache(*args._replace(kv_cache_layer=fp8))
    assert torch.equal(q, expected_q)
    written = torch.zeros(fp8.shape[1] * fp8.shape[2], dtype=torch.bool)
    written[args.slot_mapping[args.slot_mapping >= 0]] = True
    written = written.view(fp8.shape[1], fp8.shape[2])
    assert torch.equal(_bytes(fp8[:, written]), _bytes(wide[:, written].to(FP8)))
    assert torch.equal(_bytes(fp8[:, ~written]), _bytes(untouched[:, ~written]))
    if scale > 1:
        assert (fp8[:, written].float().abs() == 448).any()  # saturated, never NaN
    assert not fp8.float().isnan().any()


def test_ref_rotary_into_fp8_is_the_wide_write_converted(device) -> None:
    args = rotary_inputs(torch.bfloat16, 16, 4, 2, 64, device)
    wide, fp8 = args.kv_cache_layer.clone(), args.kv_cache_layer.to(FP8)
    ref_rotary_embedding_and_cache(*args._replace(kv_cache_layer=wide))
    ref_rotary_embedding_and_cache(*args._replace(kv_cache_layer=fp8))
    slots = args.slot_mapping[args.slot_mapping >= 0]
    rows = (slots // 16, slots % 16)
    assert torch.equal(_bytes(fp8[:, rows[0], rows[1]]), _bytes(wide[:, rows[0], rows[1]].to(FP8)))


def _fp8_context(paged_context: Callable, seq_lens, dtype):  # type: ignore[no-untyped-def]
    ctx = paged_context(seq_lens, 16, 2, 64, dtype)
    fp8 = (ctx.kv_cache_layer.float() * 40).to(FP8)  # spread over e4m3's range, saturated tails
    return ctx, fp8, fp8.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("partition", [None, 32], ids=["whole", "split"])
def test_decode_over_fp8_is_decode_over_the_widened_cache(
    dtype: torch.dtype, partition: int | None, paged_context: Callable, device
) -> None:
    ctx, fp8, widened = _fp8_context(paged_context, [1, 17, 70, 129], dtype)
    q = torch.randn(4, 8, 64, device=device).to(dtype)
    plan = None if partition is None else DecodePlan(4, partition, partition)
    out = paged_decode_attention(q, fp8, ctx.block_tables, ctx.seq_lens, 0.125, plan=plan)
    expected = paged_decode_attention(q, widened, ctx.block_tables, ctx.seq_lens, 0.125, plan=plan)
    assert out.dtype == dtype and torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_fp8_is_prefill_over_the_widened_cache(
    dtype: torch.dtype, paged_context: Callable, device
) -> None:
    seq_lens, query_lens = [20, 48, 9], [20, 15, 1]
    ctx, fp8, widened = _fp8_context(paged_context, seq_lens, dtype)
    q = torch.randn(sum(query_lens), 8, 64, device=device).to(dtype)
    qsl = torch.tensor([0, 20, 35, 36], dtype=torch.int32, device=device)
    args = (ctx.block_tables, qsl, ctx.seq_lens, max(query_lens), 0.125)
    out = paged_prefill_attention(q, fp8, *args)
    assert torch.equal(out, paged_prefill_attention(q, widened, *args))


def test_a_cache_of_another_wide_dtype_is_refused(paged_context: Callable, device) -> None:
    ctx = paged_context([5], 16, 2, 64, torch.float32)
    q = torch.randn(1, 8, 64, device=device).to(torch.float16)
    half = ctx.kv_cache_layer.to(torch.bfloat16)  # fp16 queries take fp16 or FP8 K/V only
    with pytest.raises(ValueError, match="q must have dtype in"):
        paged_decode_attention(q, half, ctx.block_tables, ctx.seq_lens, 0.125)


def test_block_copies_move_fp8_blocks_as_bytes(device) -> None:
    """The connector's and host tier's gather/scatter kernels over an FP8 cache: the same bytes
    out, the same bytes back (nothing converted on the way)."""
    from kernels.block_copy import gather_blocks, ref_gather_blocks, scatter_blocks

    cache = (torch.randn(3, 2, 10, 16, 2, 64, device=device) * 50).to(FP8)
    ids = torch.tensor([7, 2, 9], device=device)
    packed = gather_blocks(cache, ids)
    assert torch.equal(_bytes(packed), _bytes(ref_gather_blocks(cache, ids)))
    target = torch.zeros_like(cache)
    scatter_blocks(target, ids, packed)
    assert torch.equal(_bytes(target[:, :, ids]), _bytes(cache[:, :, ids]))
    assert not _bytes(target[:, :, [0, 1, 3]]).any()
