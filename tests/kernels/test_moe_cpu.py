"""``torch.ops.pdserve.moe_decode`` (``csrc/moe_cpu.c``): a MoE MLP's decode step in one native
call, against its ref (HF's router + the gathered experts of ``common/models/moe_experts.py``).

The kernel rounds where the ref rounds but sums in its own order, so float32 agrees to fp32
reassociation and bfloat16 to an ulp or two of its outputs (an intermediate rounded the other
way moves a sum by one bf16 step of that term)."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import kernels.ops  # noqa: F401 - registers torch.ops.pdserve.*
from kernels import native
from kernels.moe_cpu import moe_decode_cpu, ref_moe_decode

OPS = torch.ops.pdserve
# (tokens, experts, top k, hidden, intermediate, renormalize, fp32 weights)
CASES = [
    (1, 8, 2, 64, 48, True, True),  # Mixtral: renormalised, fp32 weights
    (5, 8, 2, 128, 96, True, False),  # Qwen3-MoE, norm_topk_prob
    (16, 16, 4, 96, 40, False, False),  # Qwen3-MoE without it
    (32, 6, 2, 72, 24, True, True),  # 64 assignments: the most the model sends
]
TOLERANCE = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2**-6, atol=2**-6),
}


def _inputs(case, dtype, seed=0):
    tokens, experts, _, hidden, inter, *_ = case
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    router = torch.randn(experts, hidden, generator=gen) * 0.3
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    return [t.to(dtype) for t in (x, router, gate_up, down)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"t{c[0]}-e{c[1]}-k{c[2]}")
def test_native_equals_the_ref(case, dtype):
    assert native.load_library() is not None, native.load_error()
    x, router, gate_up, down = _inputs(case, dtype)
    k, renormalize, fp32_weights = case[2], case[5], case[6]
    got = OPS.moe_decode(x, router, gate_up, down, k, renormalize, fp32_weights)
    want = ref_moe_decode(x, router, gate_up, down, k, renormalize, fp32_weights)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got, want, **TOLERANCE[dtype])


def test_each_token_takes_its_own_top_k_experts():
    """An expert that is no token's top-k changes nothing; one that is changes that token."""
    case = (4, 8, 2, 64, 32, True, True)
    x, router, gate_up, down = _inputs(case, torch.float32, seed=3)
    chosen = torch.topk(torch.softmax(x @ router.T, -1), 2).indices
    unused = sorted(set(range(8)) - set(chosen.flatten().tolist()))
    base = moe_decode_cpu(x, router, gate_up, down, 2, True, True)
    if unused:
        poisoned = gate_up.clone()
        poisoned[unused[0]] = 1e6
        assert torch.equal(moe_decode_cpu(x, router, poisoned, down, 2, True, True), base)
    moved = down.clone()
    moved[chosen[0, 0]] *= 2
    changed = moe_decode_cpu(x, router, gate_up, moved, 2, True, True)
    assert not torch.equal(changed[0], base[0])


def test_other_dtypes_take_the_ref_and_meta_tensors_get_shapes():
    x, router, gate_up, down = _inputs(CASES[1], torch.float16)
    got = OPS.moe_decode(x, router, gate_up, down, 2, True, False)
    assert torch.equal(got, ref_moe_decode(x, router, gate_up, down, 2, True, False))
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in _inputs(CASES[0], torch.float32)]
        assert OPS.moe_decode(*fake, 2, True, True).shape == (1, 64)
