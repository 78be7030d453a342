"""Shared pieces of the kernels: launcher checks, a dot helper, device peaks, benchmark timing.

Every launcher validates its arguments here and raises ``ValueError`` with a message naming the
argument, so a wiring mistake in the attention backend fails loudly instead of reading garbage
memory inside a kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Dtypes the attention kernels compute in (fp32 accumulation inside, output in the input dtype).
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the FP8 KV cache's element type (``--kv-cache-dtype fp8``): written saturating to +-448 with
# round-to-nearest-even (torch's conversion), read widened to the queries' dtype
FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cache dtypes a kernel takes with ``dtype`` queries: the same, or FP8."""
    return (dtype, FP8_KV_DTYPE)


def check(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition`` holds."""
    if not condition:
        raise ValueError(message)


def check_dtype(name: str, tensor: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    check(
        tensor.dtype in allowed,
        f"{name} must have dtype in {[str(d) for d in allowed]}, got {tensor.dtype}",
    )


def check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Check rank and sizes; ``None`` in ``shape`` matches any size."""
    ok = tensor.dim() == len(shape) and all(
        want is None or got == want for got, want in zip(tensor.shape, shape, strict=True)
    )
    expected = tuple("*" if s is None else s for s in shape)
    check(ok, f"{name} must have shape {expected}, got {tuple(tensor.shape)}")


def check_inner_contiguous(name: str, tensor: torch.Tensor, num_dims: int) -> None:
    """Require the last ``num_dims`` dims to be densely packed (row-major).

    The kernels address those dims as one flat run of elements; the outer dims may be strided
    (e.g. ``k`` sliced out of a fused qkv projection).
    """
    expected = 1
    for dim in range(tensor.dim() - 1, tensor.dim() - 1 - num_dims, -1):
        if tensor.size(dim) != 1:
            check(
                tensor.stride(dim) == expected,
                f"{name} must be contiguous in its last {num_dims} dims, got strides "
                f"{tuple(tensor.stride())} for shape {tuple(tensor.shape)}",
            )
        expected *= tensor.size(dim)


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    check(len(set(devices.values())) == 1, f"all tensors must be on one device, got {devices}")


def check_power_of_two(name: str, value: int, minimum: int = 1) -> None:
    check(
        value >= minimum and value & (value - 1) == 0,
        f"{name} must be a power of two >= {minimum}, got {value}",
    )


def check_head_dim(head_dim: int) -> None:
    # Head dims are tiled whole (no padding masks), which keeps the inner loops mask-free;
    # 64 and 128 cover Llama/Mistral/Qwen2. tl.dot needs every dim >= 16.
    check_power_of_two("head_dim", head_dim, minimum=16)


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (``TRITON_INTERPRET=1`` at decoration)."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def check_paged_attention_args(
    q: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """The checks both paged attention launchers share: layouts, dtypes, GQA, devices."""
    check_shape("kv_cache_layer", kv_cache_layer, (2, None, None, None, None))
    _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    check_shape("q", q, (None, None, head_dim))
    check(
        q.shape[1] % num_kv_heads == 0,
        f"q heads ({q.shape[1]}) must be a multiple of kv heads ({num_kv_heads})",
    )
    check_shape("block_tables", block_tables, (None, None))
    check_shape("seq_lens", seq_lens, (block_tables.shape[0],))
    check_dtype("kv_cache_layer", kv_cache_layer, (*FLOAT_DTYPES, FP8_KV_DTYPE))
    fp8 = kv_cache_layer.dtype == FP8_KV_DTYPE
    check_dtype("q", q, FLOAT_DTYPES if fp8 else (kv_cache_layer.dtype,))
    check_dtype("block_tables", block_tables, (torch.int32,))
    check_dtype("seq_lens", seq_lens, (torch.int32,))
    check_head_dim(head_dim)
    check_power_of_two("block_size", block_size)
    check_inner_contiguous("q", q, 1)
    check_inner_contiguous("kv_cache_layer", kv_cache_layer, 3)
    check_inner_contiguous("block_tables", block_tables, 1)
    check(seq_lens.is_contiguous(), "seq_lens must be contiguous")
    check_same_device(q=q, kv_cache_layer=kv_cache_layer, block_tables=block_tables)
    check_same_device(q=q, seq_lens=seq_lens)
    if out is not None:
        check_shape("out", out, tuple(q.shape))
        check_dtype("out", out, (q.dtype,))
        check_inner_contiguous("out", out, 1)
        check_same_device(q=q, out=out)


def check_runnable(kernel: object, device: torch.device) -> None:
    """Triton runs CPU tensors only through its interpreter.

    ``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel, i.e. when a
    ``kernels`` module is first imported, so it must be set before that import.
    """
    check(
        device.type == "cuda" or interpreted(kernel),
        f"Triton kernels need CUDA tensors, got device {device}; for CPU set "
        "TRITON_INTERPRET=1 before the first import of `kernels` (or use the ref_* functions)",
    )


@triton.jit
def tile_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``tl.dot(a, b)`` accumulated in fp32.

    ``UPCAST`` (pass :func:`interpreted`) is for the interpreter only: it stores bf16 as uint16
    and its ``tl.dot`` multiplies those bit patterns as integers (triton-lang/triton#11584), so
    it gets fp32 operands instead. Products of bf16/fp16 values are exact in fp32, so this
    matches the GPU.
    """
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def paged_slots(
    block_tables_ptr,
    stride_bt_s,
    seq,
    pos,
    mask,
    stride_cache_block,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """Element offsets (within one K or V plane) of context positions ``pos`` of ``seq``,
    following its block table per token, so a tile's size is independent of the block size."""
    block = tl.load(
        block_tables_ptr + seq * stride_bt_s + pos // BLOCK_SIZE, mask=mask, other=0
    ).to(tl.int64)
    return block * stride_cache_block + (pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)


def next_power_of_two(value: int) -> int:
    return triton.next_power_of_2(max(int(value), 1))


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------


class DevicePeak(NamedTuple):
    """Datasheet peaks: HBM bandwidth (TB/s) and dense bf16 tensor-core throughput (TFLOP/s)."""

    hbm_tbps: float
    bf16_tflops: float


# Matched in order against torch.cuda.get_device_name(); PCIe parts before their SXM siblings.
_PEAKS: tuple[tuple[tuple[str, ...], DevicePeak], ...] = (
    (("H200",), DevicePeak(4.8, 989.0)),
    (("H100", "PCIE"), DevicePeak(2.0, 756.0)),
    (("H100",), DevicePeak(3.35, 989.0)),
    (("A100",), DevicePeak(2.0, 312.0)),
)


def device_peak(device: torch.device) -> DevicePeak | None:
    """The peaks of a CUDA device, or ``None`` when it is not in the table."""
    name = torch.cuda.get_device_name(device).upper()
    for needles, peak in _PEAKS:
        if all(needle in name for needle in needles):
            return peak
    return None


def cuda_or_explain(op: str) -> torch.device | None:
    """The CUDA device to benchmark on, or ``None`` after saying why there is none."""
    if not torch.cuda.is_available():
        print(f"{op} benchmark: needs a CUDA GPU (the interpreter timing would be meaningless)")
        return None
    return torch.device("cuda")


def bench_ms(fn: Callable[[], object]) -> float:
    """Median wall time of ``fn`` in milliseconds (CUDA events, L2 flushed between runs)."""
    import triton.testing  # only benchmarks need it

    return float(triton.testing.do_bench(fn, return_mode="median"))


def report(label: str, ms: float, device: torch.device, *, nbytes: int = 0, flops: int = 0) -> str:
    """Format achieved bandwidth (``nbytes``) or throughput (``flops``) against the peak."""
    peak = device_peak(device)
    if flops:
        tflops = flops / (ms * 1e-3) / 1e12
        vs = f"{100 * tflops / peak.bf16_tflops:.0f}% of bf16 peak" if peak else "unknown peak"
        line = f"{label}: {ms:8.3f} ms  {tflops:7.1f} TFLOP/s  ({vs})"
    else:
        gbps = nbytes / (ms * 1e-3) / 1e9
        vs = f"{100 * gbps / (peak.hbm_tbps * 1e3):.0f}% of peak HBM" if peak else "unknown peak"
        line = f"{label}: {ms:8.3f} ms  {gbps:7.0f} GB/s  ({vs})"
    print(line)
    return line
