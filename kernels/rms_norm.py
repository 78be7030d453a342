"""RMSNorm, alone or fused with the residual add before it (the two norms of a Llama layer).

```
x (T, hidden) ──(+ residual)──▶ r ──▶ out = weight * (r * rsqrt(mean(r²) + eps)).to(dtype)
                                 └──▶ residual_out = r           (fused_add_rms_norm only)
```

Numerics are HF ``LlamaRMSNorm``'s, so the engine's greedy output can match HF token for token:
the residual add rounded to the model dtype (HF adds in that dtype), the statistics in fp32, the
normalised row rounded to the model dtype before the weight multiply. Three implementations of
one contract: the Triton kernel (one program per row; CUDA), the native CPU kernel
(``csrc/fused_ops_cpu.c``: fp32 and bf16, bit-exact with the refs on x86) and the ``ref_*``
functions (HF's PyTorch code, op for op). Only the order of the fp32 sum of squares can differ
between them (Triton's tree vs PyTorch's cascade), by an ulp of the row's scale.
"""

from __future__ import annotations

from typing import NoReturn

import torch
import triton
import triton.language as tl

from kernels import native
from kernels._common import (
    FLOAT_DTYPES,
    bench_ms,
    check,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    check_same_device,
    check_shape,
    cuda_or_explain,
    next_power_of_two,
    report,
)

_MAX_HIDDEN = 32768  # the Triton kernel holds a whole row in one tile


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    stride_x,
    stride_residual,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # HIDDEN rounded up to a power of two
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    dtype = out_ptr.dtype.element_ty
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        r = (residual.to(tl.float32) + h).to(dtype)  # HF: residual + x, in the model dtype
        tl.store(residual_out_ptr + row * HIDDEN + cols, r, mask=mask)
        h = r.to(tl.float32)
    # mean and 1/sqrt correctly rounded, as PyTorch's CPU sum/div and rsqrt
    variance = tl.math.div_rn(tl.sum(h * h, axis=0), HIDDEN * 1.0)
    h = h * tl.math.div_rn(1.0, tl.sqrt_rn(variance + eps))
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = weight * h.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * HIDDEN + cols, out.to(dtype), mask=mask)


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    """The checks all implementations share. They run twice per layer per step, so a valid
    call is vetted by one cheap expression; the ``kernels._common`` checks explain a failure."""
    ok = (
        x.dim() == 2
        and x.dtype in FLOAT_DTYPES
        and x.stride(1) == 1
        and weight.shape == x.shape[1:]
        and weight.dtype == x.dtype
        and weight.is_contiguous()
        and weight.device == x.device
    )
    if residual is not None:
        ok = ok and (
            residual.shape == x.shape
            and residual.dtype == x.dtype
            and residual.stride(1) == 1
            and residual.device == x.device
        )
    if not ok:
        _explain(x, weight, residual)


def _explain(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> NoReturn:
    check_shape("x", x, (None, None))
    check_dtype("x", x, FLOAT_DTYPES)
    check_inner_contiguous("x", x, 1)
    check_shape("weight", weight, (x.shape[1],))
    check_dtype("weight", weight, (x.dtype,))
    check(weight.is_contiguous(), "weight must be contiguous")
    check_same_device(x=x, weight=weight)
    if residual is not None:
        check_shape("residual", residual, tuple(x.shape))
        check_dtype("residual", residual, (x.dtype,))
        check_inner_contiguous("residual", residual, 1)
        check_same_device(x=x, residual=residual)
    raise ValueError(  # left: a unit-size dim with another stride, which _check_args refuses
        f"rms_norm needs unit-stride rows: x {tuple(x.shape)} strides {tuple(x.stride())}"
    )


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_args(x, weight, residual)
    check_runnable(_rms_norm_kernel, x.device)
    num_tokens, hidden = x.shape
    check(hidden <= _MAX_HIDDEN, f"hidden size {hidden} > {_MAX_HIDDEN}: one row per tile")
    out = x.new_empty(num_tokens, hidden)
    residual_out = None if residual is None else x.new_empty(num_tokens, hidden)
    if num_tokens == 0:
        return out, residual_out
    block = next_power_of_two(hidden)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,  # unused without HAS_RESIDUAL
        weight,
        out,
        residual_out if residual_out is not None else out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        float(eps),
        HIDDEN=hidden,
        BLOCK=block,
        HAS_RESIDUAL=residual is not None,
        num_warps=min(max(block // 256, 1), 16),
        enable_fp_fusion=False,  # squares rounded before they are summed, as PyTorch's pow(2)
    )
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rms_normalised(x)`` (Triton).

    Args:
        x: ``(T, hidden)``, float32/bfloat16/float16; rows dense, the row stride free.
        weight: ``(hidden,)``, ``x``'s dtype, contiguous.
        eps: added to the mean square (in fp32).

    Returns a new contiguous ``(T, hidden)`` tensor in ``x``'s dtype.
    """
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(residual + x), residual + x)`` in one pass (Triton). ``residual`` is
    ``(T, hidden)`` like ``x``; neither input is modified; both outputs are new tensors."""
    out, residual_out = _launch(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def _native(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_args(x, weight, residual)
    native.check_cpu(x)  # the others are on x's device
    lib = native.library_for(x.dtype)
    if lib is None:
        if residual is None:
            return ref_rms_norm(x, weight, eps), None
        return ref_fused_add_rms_norm(x, residual, weight, eps)
    num_tokens, hidden = x.shape
    out = x.new_empty(num_tokens, hidden)  # row-major, whatever x's row stride
    residual_out = None if residual is None else x.new_empty(num_tokens, hidden)
    failed = lib.pdserve_rms_norm(
        out.data_ptr(),
        None if residual_out is None else residual_out.data_ptr(),
        x.data_ptr(),
        None if residual is None else residual.data_ptr(),
        weight.data_ptr(),
        num_tokens,
        hidden,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        eps,
        native.DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError("native rms_norm could not allocate its scratch row")
    return out, residual_out


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`rms_norm` on CPU tensors by the native kernel (float16, or no compiler: the ref)."""
    return _native(x, None, weight, eps)[0]


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_add_rms_norm` on CPU tensors by the native kernel (else the ref)."""
    out, residual_out = _native(x, residual, weight, eps)
    assert residual_out is not None
    return out, residual_out


def ref_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF ``LlamaRMSNorm.forward``, op for op (any device, any strides)."""
    input_dtype = x.dtype
    hidden_states = x.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def ref_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's decoder layer around a norm: ``hidden_states = residual + hidden_states``, then the
    norm; returns ``(normed, new residual)``."""
    residual = residual + x
    return ref_rms_norm(residual, weight, eps), residual


def benchmark() -> None:
    """Bandwidth of the fused add + norm of one 8k-token prefill step, Llama-3-8B width, bf16."""
    device = cuda_or_explain("rms_norm")
    if device is None:
        return
    num_tokens, hidden = 8192, 4096
    x = torch.randn(num_tokens, hidden, dtype=torch.bfloat16, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=torch.bfloat16, device=device)
    ms = bench_ms(lambda: fused_add_rms_norm(x, residual, weight, 1e-5))
    nbytes = 4 * x.numel() * x.element_size()  # x, residual read; out, residual_out written
    report(f"fused_add_rms_norm T={num_tokens} hidden={hidden}", ms, device, nbytes=nbytes)


if __name__ == "__main__":
    benchmark()
