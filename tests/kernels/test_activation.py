"""silu_and_mul (Triton) against its ref; the ref against HF's ``act_fn(gate) * up``.

The kernel repeats HF's rounding sequence (SiLU in fp32, rounded, times up, rounded); only the
``exp`` differs: NumPy's under the interpreter, libdevice's on a GPU, SLEEF's in PyTorch's CPU
SiLU. Tolerances:
- float32: 1e-6 relative (an ulp or two of the SiLU);
- float16: 2 ulps (2^-9 relative): that ulp may flip the rounding of the SiLU, then the product;
- bfloat16: 2 ulps (2^-7) on a GPU; under Triton's interpreter, whose fp32 -> bf16 casts
  truncate instead of rounding to nearest, 4 ulps (2^-6).
"""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN

from kernels.activation import ref_silu_and_mul, silu_and_mul
from tests.kernels.conftest import INTERPRETING

SHAPES = [  # (num_tokens, intermediate)
    pytest.param(1, 64, id="T1-I64"),
    pytest.param(3, 8192, id="T3-I8192-llama3.2-1b"),
    pytest.param(5, 352, id="T5-I352-tiny-llama"),
    pytest.param(2, 100, id="T2-I100-odd"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rtol(dtype: torch.dtype) -> float:
    if dtype == torch.bfloat16:
        return 2**-6 if INTERPRETING else 2**-7
    return {torch.float32: 1e-6, torch.float16: 2**-9}[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "intermediate"), SHAPES)
def test_matches_ref(num_tokens, intermediate, dtype, device) -> None:
    # a slice of a wider tensor: the row stride is free; gates out to +-12 cover SiLU's tails
    x = (4 * torch.randn(num_tokens, 2 * intermediate + 32, device=device)).to(dtype)
    x = x[:, : 2 * intermediate]
    out = silu_and_mul(x)
    assert out.shape == (num_tokens, intermediate) and out.is_contiguous()
    rtol = _rtol(dtype)
    torch.testing.assert_close(out.float(), ref_silu_and_mul(x).float(), rtol=rtol, atol=rtol)


def test_empty_batch(device) -> None:
    assert silu_and_mul(torch.empty(0, 128, device=device)).shape == (0, 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "intermediate"), [(1, 64), (7, 352), (3, 2048)])
def test_ref_is_hf_act_fn_times_up(num_tokens, intermediate, dtype) -> None:
    """Bit for bit, with HF's separate gate and up projections. (Widths are whole multiples of
    PyTorch's vector step, 32, as in real models: PyTorch's CPU SiLU computes a remainder with
    libm's exp rather than SLEEF's, and where a remainder falls depends on the tensor's layout.)
    """
    gate = (4 * torch.randn(num_tokens, intermediate)).to(dtype)
    up = torch.randn(num_tokens, intermediate).to(dtype)
    hf = ACT2FN["silu"](gate) * up
    assert torch.equal(ref_silu_and_mul(torch.cat((gate, up), dim=-1)), hf)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from kernels.activation import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
