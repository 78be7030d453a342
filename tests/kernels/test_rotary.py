"""rotary_embedding_and_cache (Triton) against its ref; the ref and the cos/sin table against HF.

No step of RoPE is a reduction, so the kernel repeats HF's rounding sequence exactly: every
comparison is ``torch.equal``, except bfloat16 under Triton's interpreter, whose fp32 -> bf16
casts truncate instead of rounding to nearest (its ``cast_impl`` passes no rounding mode): each
of the three rounded steps may then be up to one bf16 ulp off, which a cancelling sum can make
large against the result, so that case is held to three ulps of the largest intermediate value.
On a GPU the casts round to nearest and bfloat16 is exact too.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.rotary import (
    ref_rotary_embedding_and_cache,
    rope_cos_sin_cache,
    rotary_embedding_and_cache,
)
from tests.kernels.conftest import INTERPRETING

MAX_POSITIONS = 4096

CASES = [  # (dtype, block_size, num_heads, num_kv_heads, head_dim)
    pytest.param(torch.float32, 16, 32, 8, 64, id="fp32-bs16-llama3.2-1b"),
    pytest.param(torch.bfloat16, 32, 8, 2, 128, id="bf16-bs32-gqa4-d128"),
    pytest.param(torch.float16, 16, 4, 4, 64, id="fp16-bs16-mha"),
    pytest.param(torch.float32, 32, 4, 1, 128, id="fp32-bs32-mqa-d128"),
    pytest.param(torch.bfloat16, 16, 6, 2, 80, id="bf16-bs16-d80"),
]


class RotaryInputs(NamedTuple):
    qkv: torch.Tensor  # (T, (H + 2 Hkv) * D)
    positions: torch.Tensor  # (T,) int64
    cos_sin_cache: torch.Tensor  # (MAX_POSITIONS, D)
    kv_cache_layer: torch.Tensor  # (2, N, bs, Hkv, D), random: a stray write shows
    slot_mapping: torch.Tensor  # (T,) int64, scattered, -1 for padding
    num_heads: int
    num_kv_heads: int


def rotary_inputs(
    dtype: torch.dtype,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    row_padding: int = 0,
) -> RotaryInputs:
    """Nine tokens: block edges, the last slot of the cache, the last table row, and two padding
    tokens at position 0. ``row_padding`` widens qkv's row stride (a slice of a wider tensor)."""
    num_blocks = 6
    last = num_blocks * block_size - 1
    slots = [0, block_size - 1, block_size, -1, 3 * block_size + 5, last, 2, -1, 4 * block_size]
    positions = [0, 1, 17, 0, 1000, MAX_POSITIONS - 1, 5, 0, 63]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(len(slots), width + row_padding, device=device)).to(dtype)[:, :width]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=device) / head_dim))
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    return RotaryInputs(
        qkv,
        torch.tensor(positions, device=device),
        rope_cos_sin_cache(inv_freq, MAX_POSITIONS, dtype),
        torch.randn(shape, device=device).to(dtype),
        torch.tensor(slots, device=device),
        num_heads,
        num_kv_heads,
    )


def _assert_matches(actual: torch.Tensor, expected: torch.Tensor, qkv: torch.Tensor) -> None:
    if actual.dtype == torch.bfloat16 and INTERPRETING:
        # every product and sum is at most 1.5 max|qkv|, and a truncation loses < 2^-7 of it
        bound = 3 * 2**-7 * 1.5 * float(qkv.float().abs().max())
        torch.testing.assert_close(actual.float(), expected.float(), atol=bound, rtol=0)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize(("dtype", "block_size", "num_heads", "num_kv_heads", "head_dim"), CASES)
def test_matches_ref(dtype, block_size, num_heads, num_kv_heads, head_dim, device) -> None:
    args = rotary_inputs(dtype, block_size, num_heads, num_kv_heads, head_dim, device)
    expected_cache = args.kv_cache_layer.clone()
    expected_q = ref_rotary_embedding_and_cache(*args._replace(kv_cache_layer=expected_cache))
    q = rotary_embedding_and_cache(*args)
    assert q.shape == (9, num_heads, head_dim) and q.is_contiguous()
    _assert_matches(q, expected_q, args.qkv)
    _assert_matches(args.kv_cache_layer, expected_cache, args.qkv)


def test_writes_exactly_the_named_slots(device) -> None:
    """Padding tokens write nothing; the others write their K and V rows and nothing else."""
    args = rotary_inputs(torch.float32, 16, 4, 2, 64, device, row_padding=64)
    before = args.kv_cache_layer.clone()
    rotary_embedding_and_cache(*args)
    changed = (args.kv_cache_layer != before).flatten(3).any(dim=3)  # (2, N, bs)
    slots = [s for s in args.slot_mapping.tolist() if s >= 0]
    expected = sorted([kv, s // 16, s % 16] for kv in (0, 1) for s in slots)
    assert changed.nonzero().tolist() == expected
    v = args.qkv[:, 6 * 64 :].reshape(9, 2, 64)
    flat_v = args.kv_cache_layer[1].reshape(-1, 2, 64)  # slot-major: row `slot` is that token
    for t, slot in enumerate(args.slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat_v[slot], v[t])


def test_empty_batch(device) -> None:
    args = rotary_inputs(torch.float32, 16, 4, 2, 64, device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    args = args._replace(qkv=args.qkv[:0], positions=empty, slot_mapping=empty)
    before = args.kv_cache_layer.clone()
    assert rotary_embedding_and_cache(*args).shape == (0, 4, 64)
    assert torch.equal(args.kv_cache_layer, before)


def _hf_rotary(rope_scaling: dict | None, head_dim: int) -> LlamaRotaryEmbedding:
    config = LlamaConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=500000.0,
        rope_scaling=rope_scaling,
    )
    return LlamaRotaryEmbedding(config)


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["default", "llama3"])
def test_cos_sin_cache_holds_hf_values(dtype, rope_scaling) -> None:
    hf = _hf_rotary(rope_scaling, head_dim=64)
    positions = torch.tensor([[0, 1, 2, 17, 1000, 2047, 2048, 4095]])
    cos, sin = hf(torch.empty(1, dtype=dtype), positions)  # (1, P, D), HF's cat((f, f)) layout
    table = rope_cos_sin_cache(hf.inv_freq, MAX_POSITIONS, dtype)[positions[0]]
    assert table.dtype == dtype
    assert torch.equal(table, torch.cat((cos[0, :, :32], sin[0, :, :32]), dim=-1))
    assert torch.equal(cos[0, :, :32], cos[0, :, 32:])  # what the kernels' half table assumes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ref_is_hf_apply_rotary_pos_emb(dtype) -> None:
    """HF: q/k (B, H, T, D), cos/sin (B, T, D); here the tokens are the batch, one step each."""
    args = rotary_inputs(dtype, 16, 8, 2, 64, torch.device("cpu"))
    hf = _hf_rotary(LLAMA3_SCALING, head_dim=64)
    args = args._replace(cos_sin_cache=rope_cos_sin_cache(hf.inv_freq, MAX_POSITIONS, dtype))
    q, k, v = args.qkv.split([8 * 64, 2 * 64, 2 * 64], dim=-1)
    cos, sin = hf(torch.empty(1, dtype=dtype), args.positions[:, None])  # (T, 1, D)
    q_hf, k_hf = apply_rotary_pos_emb(
        q.reshape(9, 8, 1, 64), k.reshape(9, 2, 1, 64), cos, sin, unsqueeze_dim=1
    )
    q_ref = ref_rotary_embedding_and_cache(*args)
    assert torch.equal(q_ref, q_hf[:, :, 0])
    flat = args.kv_cache_layer.reshape(2, -1, 2, 64)  # slot-major
    for t, slot in enumerate(args.slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat[0, slot], k_hf[t, :, 0])
            assert torch.equal(flat[1, slot], v[t].reshape(2, 64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from kernels.rotary import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
