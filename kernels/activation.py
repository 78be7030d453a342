"""SiLU-and-mul: the activation of a Llama MLP on the fused gate|up projection's output.

```
x (T, 2I) = [ gate | up ]  ──▶  out (T, I) = silu(gate) * up
```

Numerics are HF's ``act_fn(gate_proj(x)) * up_proj(x)`` in the model dtype: the SiLU in fp32,
rounded to the model dtype, then the product rounded again. Three implementations of one
contract: the Triton kernel (one program per tile of one row; CUDA), the native CPU kernel
(``csrc/fused_ops_cpu.c``: fp32 and bf16, bit-exact with the ref on x86: it computes ``exp``
with SLEEF's algorithm, as PyTorch's vectorised SiLU does) and :func:`ref_silu_and_mul`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import native
from kernels._common import (
    FLOAT_DTYPES,
    bench_ms,
    check,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    check_shape,
    cuda_or_explain,
    interpreted,
    next_power_of_two,
    report,
)

_MAX_TILE = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    INTERMEDIATE: tl.constexpr,
    TILE: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,  # False only in the interpreter, which lacks libdevice
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * TILE + tl.arange(0, TILE)
    mask = cols < INTERMEDIATE
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + row * stride_x + cols
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + INTERMEDIATE, mask=mask, other=0.0).to(tl.float32)
    # PyTorch's CUDA SiLU: x / (1 + expf(-x)), IEEE division; tl.exp would be ex2.approx
    if ACCURATE_EXP:
        denominator = 1.0 + libdevice.exp(-gate)
    else:
        denominator = 1.0 + tl.exp(-gate)
    silu = tl.math.div_rn(gate, denominator).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * INTERMEDIATE + cols, (silu * up).to(dtype), mask=mask)


def _check_args(x: torch.Tensor) -> None:
    """Shared by both implementations; a valid call costs one cheap expression (this runs once
    per layer per step), the ``kernels._common`` checks explain a failure."""
    if x.dim() == 2 and x.shape[1] % 2 == 0 and x.dtype in FLOAT_DTYPES and x.stride(1) == 1:
        return
    check_shape("x", x, (None, None))
    check(x.shape[1] % 2 == 0, f"x must be [gate | up] of even width, got {x.shape[1]}")
    check_dtype("x", x, FLOAT_DTYPES)
    check_inner_contiguous("x", x, 1)
    raise ValueError(f"silu_and_mul needs unit-stride rows: x strides {tuple(x.stride())}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` (Triton).

    Args:
        x: ``(T, 2I)``, float32/bfloat16/float16; rows dense, the row stride free.

    Returns a new contiguous ``(T, I)`` tensor in ``x``'s dtype.
    """
    _check_args(x)
    check_runnable(_silu_and_mul_kernel, x.device)
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    out = x.new_empty(num_tokens, intermediate)
    if out.numel() == 0:
        return out
    tile = min(next_power_of_two(intermediate), _MAX_TILE)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(intermediate, tile))](
        x,
        out,
        x.stride(0),
        INTERMEDIATE=intermediate,
        TILE=tile,
        ACCURATE_EXP=not interpreted(_silu_and_mul_kernel),
    )
    return out


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """:func:`silu_and_mul` on a CPU tensor by the native kernel (float16, or no compiler: the
    ref)."""
    _check_args(x)
    native.check_cpu(x)
    lib = native.library_for(x.dtype)
    if lib is None:
        return ref_silu_and_mul(x)
    num_tokens, width = x.shape
    intermediate = width // 2
    out = x.new_empty(num_tokens, intermediate)
    lib.pdserve_silu_and_mul(
        out.data_ptr(),
        x.data_ptr(),
        num_tokens,
        intermediate,
        x.stride(0),
        native.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    return out


def ref_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """HF's ``act_fn(gate) * up`` (``ACT2FN["silu"]`` is ``F.silu``), op for op."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def benchmark() -> None:
    """Bandwidth of the activation of one 8k-token prefill step, Llama-3-8B MLP, bf16."""
    device = cuda_or_explain("silu_and_mul")
    if device is None:
        return
    num_tokens, intermediate = 8192, 14336
    x = torch.randn(num_tokens, 2 * intermediate, dtype=torch.bfloat16, device=device)
    ms = bench_ms(lambda: silu_and_mul(x))
    nbytes = 3 * num_tokens * intermediate * x.element_size()  # gate, up read; out written
    report(f"silu_and_mul T={num_tokens} I={intermediate}", ms, device, nbytes=nbytes)


if __name__ == "__main__":
    benchmark()
