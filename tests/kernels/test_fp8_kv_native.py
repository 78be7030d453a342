"""The float8_e4m3fn KV cache of the native CPU kernels (csrc/bf16.h, paged_attention_cpu.c,
fused_ops_cpu.c), held to PyTorch bit for bit:

- the conversions (bf16.h's, through the exported test helpers) against ``.to()``;
- RoPE + cache write into an fp8 cache == the same call into a cache of the model dtype, then
  ``.to(torch.float8_e4m3fn)``;
- decode over an fp8 cache == decode over ``cache.to(query.dtype)`` (e4m3 values are exact in
  bf16 and fp32, and the kernel widens them exactly).

The rotary C function is called through ctypes here, with its ``cache_dtype`` argument.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

import kernels.ops  # noqa: F401  (registers torch.ops.pdserve)
from kernels import cpu_attention, native
from kernels.rotary import ref_rotary_embedding_and_cache
from tests.kernels.conftest import build_paged_context
from tests.kernels.test_rotary import rotary_inputs

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    library = native.load_library()
    assert library is not None, native.load_error()
    return library


def _to_e4m3(lib: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """x (float32) converted by the C code, as bytes."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8)
    assert lib.pdserve_f32_to_e4m3(x.data_ptr(), out.data_ptr(), x.numel()) == 0
    return out


def _assert_bits_equal(lib: ctypes.CDLL, x: torch.Tensor) -> None:
    actual = _to_e4m3(lib, x)
    expected = x.to(FP8).view(torch.uint8)
    bad = (actual != expected).nonzero().flatten()
    assert bad.numel() == 0, [
        (hex(int(x.view(torch.int32)[i])), int(actual[i]), int(expected[i])) for i in bad[:8]
    ]


def test_read_conversion_is_exact(lib) -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out = torch.empty(256, dtype=torch.float32)
    assert lib.pdserve_e4m3_to_f32(codes.data_ptr(), out.data_ptr(), 256) == 0
    # bit patterns, so the two NaNs (0x7f, 0xff) and -0.0 count too
    assert torch.equal(out.view(torch.int32), codes.view(FP8).float().view(torch.int32))


def test_write_conversion_all_bf16_patterns(lib) -> None:
    bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    _assert_bits_equal(lib, bf16.float())


def test_write_conversion_random_float32(lib) -> None:
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (40_000,), dtype=torch.int64, generator=gen)
    any_float = bits.to(torch.int32).view(torch.float32)  # NaNs, infs, huge, tiny, denormals
    # every e4m3 value, the midpoints between neighbours (ties) and one ulp either side
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = values[~values.isnan()].unique()  # sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32
    ties = torch.cat([mids, grid, torch.tensor([464.0, -464.0, 480.0, 479.9, 1e38, 2**-10])])
    ties = torch.cat([ties, ties.nextafter(ties + 1), ties.nextafter(ties - 1)])
    uniform = [(torch.rand(20_000, generator=gen) * 2 - 1) * scale for scale in (2**-6, 1.0, 500.0)]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")])
    for x in (any_float, ties, *uniform, special):
        _assert_bits_equal(lib, x)


def _rotary_c(lib: ctypes.CDLL, args, cache: torch.Tensor) -> torch.Tensor:
    """The native rotary call as kernels/rotary.py makes it, with `cache` (a layer view of
    qkv's dtype or fp8) and its cache_dtype code."""
    qkv, positions, cos_sin, _, slots, num_heads, num_kv_heads = args
    _, num_blocks, block_size, _, head_dim = cache.shape
    q_out = qkv.new_empty(qkv.shape[0], num_heads, head_dim)
    failed = lib.pdserve_rotary_embedding_and_cache(
        q_out.data_ptr(),
        cache.data_ptr(),
        qkv.data_ptr(),
        positions.data_ptr(),
        cos_sin.data_ptr(),
        slots.data_ptr(),
        qkv.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        qkv.stride(0),
        cache.stride(0),
        cache.stride(1),
        cos_sin.shape[0],
        num_blocks * block_size,
        native.DTYPE_CODES[qkv.dtype],
        native.CACHE_DTYPE_CODES[cache.dtype],
        torch.get_num_threads(),
    )
    assert failed == 0
    return q_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (4, 1, 128)])
def test_rotary_into_fp8_cache(lib, dtype, num_heads, num_kv_heads, head_dim) -> None:
    block_size = 16
    args = rotary_inputs(dtype, block_size, num_heads, num_kv_heads, head_dim, CPU, row_padding=8)
    # magnitudes from e4m3's subnormals to past its saturation, token by token
    scale = torch.tensor([1.0, 300.0, 2**-8, 1.0, 40.0, 2**-12, 1000.0, 1.0, 0.5])
    qkv_wide = (args.qkv.float() * scale[:, None]).to(dtype)
    qkv = torch.cat([qkv_wide, qkv_wide[:, :8]], dim=1)[:, : qkv_wide.shape[1]]  # strided rows
    args = args._replace(qkv=qkv)
    # layer 1 of a three-layer fp8 cache of random (non-NaN) bytes
    raw = torch.randint(0, 256, (3, *args.kv_cache_layer.shape), dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0
    before = raw.clone()
    fp8_cache = raw.view(FP8)
    wide_cache = fp8_cache.to(dtype)  # the same values in the model dtype

    q_fp8 = _rotary_c(lib, args, fp8_cache[1])
    q_wide = _rotary_c(lib, args, wide_cache[1])
    expected_cache = fp8_cache.to(dtype)
    expected_q = ref_rotary_embedding_and_cache(*args._replace(kv_cache_layer=expected_cache[1]))

    assert torch.equal(q_wide, expected_q) and torch.equal(wide_cache, expected_cache)
    assert torch.equal(q_fp8, q_wide)
    assert torch.equal(raw, wide_cache.to(FP8).view(torch.uint8))
    # the slots written and only those (layers 0 and 2 untouched)
    written = torch.zeros(raw.shape[2] * raw.shape[3], dtype=torch.bool)
    written[args.slot_mapping[args.slot_mapping >= 0]] = True
    changed = (raw != before).flatten(4).any(-1).flatten(2).any(1)  # (layers, slots)
    assert not changed[0].any() and not changed[2].any()
    assert not changed[1][~written].any()
    assert changed[1][written].all()


def _decode(q, kv, ctx, partition_size, query_start_loc):
    out = torch.zeros_like(q)
    max_len = int(ctx.seq_lens.max())
    return cpu_attention.paged_decode_attention(
        q, kv, ctx.block_tables, ctx.seq_lens, query_start_loc, max_len, 0.1, out, partition_size
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(8, 2, 64), (6, 2, 80)])
@pytest.mark.parametrize("partition_size", [32, 0])
def test_decode_fp8_cache_equals_widened_cache(
    dtype, num_heads, num_kv_heads, head_dim, partition_size
) -> None:
    seq_lens = [1, 16, 37, 300, 700]
    ctx = build_paged_context(seq_lens, 16, num_kv_heads, head_dim, torch.float32, CPU)
    fp8_cache = (4 * ctx.kv_cache_layer).to(FP8)
    q = torch.randn(len(seq_lens), num_heads, head_dim).to(dtype)
    starts = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    out = _decode(q, fp8_cache, ctx, partition_size, starts)
    assert torch.equal(out, _decode(q, fp8_cache.to(dtype), ctx, partition_size, starts))
    assert out.abs().sum() > 0


def test_decode_fp8_cache_skips_prefill_rows_and_runs_as_op() -> None:
    seq_lens = [40, 3, 500]
    ctx = build_paged_context(seq_lens, 16, 2, 64, torch.float32, CPU)
    fp8_cache = ctx.kv_cache_layer.to(FP8)
    q = torch.randn(5, 4, 64).to(torch.bfloat16)
    starts = torch.tensor([0, 1, 4, 5], dtype=torch.int32)  # sequence 1 is a 3-token prefill
    out = _decode(q, fp8_cache, ctx, 0, starts)
    assert torch.equal(out, _decode(q, fp8_cache.to(torch.bfloat16), ctx, 0, starts))
    assert not out[1:4].any()
    op = torch.ops.pdserve.paged_decode_attention_cpu(
        q, fp8_cache, ctx.block_tables, ctx.seq_lens, starts, 500, 0.1
    )
    assert torch.equal(op[[0, 4]], out[[0, 4]])


@pytest.mark.parametrize(
    ("query_dtype", "cache_dtype"),
    [(torch.bfloat16, torch.float16), (torch.float32, torch.bfloat16), (torch.float16, FP8)],
)
def test_decode_refuses_other_cache_dtypes(query_dtype, cache_dtype) -> None:
    ctx = build_paged_context([5, 20], 16, 2, 64, torch.float32, CPU)
    q = torch.randn(2, 4, 64).to(query_dtype)
    with pytest.raises(ValueError, match="dtype"):
        _decode(q, ctx.kv_cache_layer.to(cache_dtype), ctx, 0, torch.arange(3, dtype=torch.int32))
