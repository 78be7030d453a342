"""rms_norm / fused_add_rms_norm (Triton) against their refs; the refs against HF's LlamaRMSNorm.

The kernel sums the squares in a tree, PyTorch in its cascade order, so the row's scale may
differ by an ulp or two of fp32; everything else repeats HF's rounding sequence. Tolerances:
- float32: 1e-6 relative (a few ulps of the scale);
- float16: 2 ulps (2^-9 relative): the scale's ulp may flip the rounding of the normalised row,
  and then of the product with the weight;
- bfloat16: 2 ulps (2^-7) on a GPU; under Triton's interpreter, whose fp32 -> bf16 casts
  truncate instead of rounding to nearest, 4 ulps (2^-6).
The residual sum is one rounded add: exact, but for bfloat16 under the interpreter (1 ulp).
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from kernels.rms_norm import (
    fused_add_rms_norm,
    ref_fused_add_rms_norm,
    ref_rms_norm,
    rms_norm,
)
from tests.kernels.conftest import INTERPRETING

EPS = 1e-5

SHAPES = [  # (num_tokens, hidden)
    pytest.param(1, 256, id="T1-h256"),
    pytest.param(5, 2048, id="T5-h2048-llama3.2-1b"),
    pytest.param(3, 896, id="T3-h896-qwen2-0.5b"),
    pytest.param(4, 100, id="T4-h100-odd"),
    pytest.param(2, 7, id="T2-h7-below-one-vector"),
]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _rtol(dtype: torch.dtype) -> float:
    if dtype == torch.bfloat16:
        return 2**-6 if INTERPRETING else 2**-7
    return {torch.float32: 1e-6, torch.float16: 2**-9}[dtype]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol = _rtol(actual.dtype)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=rtol)


def _inputs(num_tokens, hidden, dtype, device, row_padding=0):
    """x (a slice of a wider tensor when row_padding > 0), residual, weight."""
    x = (3 * torch.randn(num_tokens, hidden + row_padding, device=device)).to(dtype)
    residual = torch.randn(num_tokens, hidden, device=device).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    return x[:, :hidden], residual, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), SHAPES)
def test_rms_norm_matches_ref(num_tokens, hidden, dtype, device) -> None:
    x, _, weight = _inputs(num_tokens, hidden, dtype, device, row_padding=16)
    out = rms_norm(x, weight, EPS)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype and out.is_contiguous()
    _assert_close(out, ref_rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), SHAPES)
def test_fused_add_rms_norm_matches_ref(num_tokens, hidden, dtype, device) -> None:
    x, residual, weight = _inputs(num_tokens, hidden, dtype, device)
    x_before, residual_before = x.clone(), residual.clone()
    out, residual_out = fused_add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_residual = ref_fused_add_rms_norm(x, residual, weight, EPS)
    _assert_close(out, expected_out)
    if dtype == torch.bfloat16 and INTERPRETING:
        torch.testing.assert_close(residual_out, expected_residual, rtol=2**-7, atol=2**-7)
    else:
        assert torch.equal(residual_out, expected_residual)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)  # inputs kept


def test_empty_batch(device) -> None:
    x, residual, weight = _inputs(0, 64, torch.float32, device)
    assert rms_norm(x, weight, EPS).shape == (0, 64)
    assert [t.shape for t in fused_add_rms_norm(x, residual, weight, EPS)] == [(0, 64)] * 2


def test_refuses_rows_wider_than_one_tile(device) -> None:
    x, _, weight = _inputs(1, 32768 + 1, torch.float32, device)
    with pytest.raises(ValueError, match="hidden size 32769"):
        rms_norm(x, weight, EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), SHAPES)
def test_refs_are_hf_llama_rms_norm(num_tokens, hidden, dtype) -> None:
    """Bit for bit, HF's LlamaRMSNorm and its decoder layer's residual add around it."""
    x, residual, weight = _inputs(num_tokens, hidden, dtype, torch.device("cpu"))
    norm = LlamaRMSNorm(hidden, eps=EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
        assert torch.equal(ref_rms_norm(x, weight, EPS), norm(x))
        hidden_states = residual + x  # HF: hidden_states = residual + hidden_states
        out, residual_out = ref_fused_add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(residual_out, hidden_states)
        assert torch.equal(out, norm(hidden_states))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from kernels.rms_norm import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
