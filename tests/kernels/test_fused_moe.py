"""The fused MoE kernels (``kernels/fused_moe.py``; interpreted on CPU, compiled on CUDA) against
the plain, HF-exact path, and the alignment that keeps every size off the host."""

from __future__ import annotations

import pytest
import torch

from common.models.moe import route
from kernels.fused_moe import BLOCK_M, fused_moe, moe_align, ref_fused_moe


def test_alignment_groups_each_experts_assignments_in_padded_runs():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2]])  # expert 1 has none
    sorted_ids, block_expert = moe_align(ids, num_experts=5, block_m=4)
    pad = ids.numel()
    size = -(-(pad + 5 * 3) // 4) * 4
    assert sorted_ids.shape == (size,) and block_expert.shape == (size // 4,)
    runs = sorted_ids.view(-1, 4).tolist()
    assert runs[0] == [1, 4, pad, pad]  # expert 0: assignments t·k + j, in token order
    assert runs[1] == [0, 2, 5, 7]  # expert 2
    assert runs[2] == [3, 6, pad, pad]  # expert 3
    assert block_expert.tolist()[:3] == [0, 2, 3]
    assert set(block_expert.tolist()[3:]) == {5}  # past every run: the sentinel
    assert all(v == pad for v in sorted_ids.tolist()[12:])


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, fp32_weights):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g).to(dtype)
    weights, ids = route(logits, top_k, True, torch.float32 if fp32_weights else dtype)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    [
        (1, 4, 2, 64, 96),  # one decode row: most row blocks are the sentinel's
        (5, 6, 3, 32, 48),  # widths that are not a multiple of the tiles
        (37, 8, 2, 64, 64),  # several blocks per expert, some experts idle
    ],
)
@pytest.mark.parametrize("fp32_weights", [True, False], ids=["mixtral", "qwen3-moe"])
def test_fused_moe_agrees_with_the_plain_path_in_fp32(
    device, tokens, experts, top_k, hidden, inter, fp32_weights
):
    args = _case(tokens, experts, top_k, hidden, inter, torch.float32, fp32_weights)
    want = ref_fused_moe(*args)
    got = fused_moe(*(a.to(device) for a in args)).cpu()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)  # fp32: reassociation only


def test_fused_moe_agrees_in_bf16(device):
    args = _case(37, 8, 2, 64, 64, torch.bfloat16, False)
    want = ref_fused_moe(*args).float()
    got = fused_moe(*(a.to(device) for a in args)).cpu().float()
    # bf16 rounding points as the plain path's; the inner sums' order differs
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_an_expert_with_every_token_spans_many_blocks(device):
    x, gate_up, down, weights, _ = _case(3 * BLOCK_M + 1, 4, 2, 32, 32, torch.float32, True)
    ids = torch.zeros_like(weights, dtype=torch.int64)
    ids[:, 1] = 3  # every token: experts 0 and 3
    want = ref_fused_moe(x, gate_up, down, weights, ids)
    got = fused_moe(*(a.to(device) for a in (x, gate_up, down, weights, ids))).cpu()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_the_kernels_compile_for_sm80_and_sm90(tmp_path):
    """Through ``kernels.cross_compile`` (no GPU): both launches at Qwen3-30B-A3B's MoE shape."""
    from tests.kernels.cross_compile_child import run_child

    cases = [{"arch": arch, "dtype": "bfloat16"} for arch in (80, 90)]
    answer = run_child("moe", cases, tmp_path, timeout=600)
    assert answer["restored"]
    for case in answer["cases"]:
        kernels = sorted((v["kernel"], v["constants"]["GATE_UP"]) for v in case["variants"])
        assert kernels == [("_moe_gemm_kernel", False), ("_moe_gemm_kernel", True)], case
        assert all(v["arch"] == case["arch"] and v["cubin_bytes"] > 0 for v in case["variants"])


def test_alignment_runs_on_meta_tensors():
    """Every size follows the shapes, none a value: on ``meta`` tensors (no data) it runs, so
    on CUDA nothing is read on the host and a graph can capture it (``bincount`` could not:
    its output size is the largest id)."""
    ids = torch.empty(4, 8, dtype=torch.int64, device="meta")
    sorted_ids, block_expert = moe_align(ids, num_experts=128)
    size = -(-(32 + 128 * (BLOCK_M - 1)) // BLOCK_M) * BLOCK_M
    assert sorted_ids.shape == (size,) and block_expert.shape == (size // BLOCK_M,)
    with pytest.raises(NotImplementedError):  # what the plain path's count read does there
        torch.bincount(ids.flatten(), minlength=128).tolist()


def test_expert_parallel_shares_sum_to_the_whole(device):
    """Two ranks' calls, each over half of the experts, with an all-reduce that sums the two
    shares (as the group's does): each rank returns the one-device result."""
    x, gate_up, down, weights, ids = (
        a.to(device) for a in _case(9, 6, 3, 32, 48, torch.float32, True)
    )
    want = fused_moe(x, gate_up, down, weights, ids)
    shares: list[torch.Tensor] = []

    def keep(routed: torch.Tensor) -> torch.Tensor:
        shares.append(routed.clone())
        return routed

    for first in (0, 3):  # each share: only this rank's assignments' rows are nonzero
        fused_moe(x, gate_up[first : first + 3], down[first : first + 3], weights, ids,
                  first_expert=first, all_reduce=keep)  # fmt: skip
    total = shares[0] + shares[1]
    assert ((shares[0] != 0).any(dim=1) & (shares[1] != 0).any(dim=1)).sum() == 0
    for first in (0, 3):
        got = fused_moe(x, gate_up[first : first + 3], down[first : first + 3], weights, ids,
                        first_expert=first, all_reduce=lambda routed: total)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_fp8_experts_reach_the_kernel_dequantized(device):
    """FP8 experts on CUDA: the rank's experts dequantized to the model dtype
    (``Experts.dequantized``), then the same kernel; it agrees with the CPU path over the FP8
    weights and their per-channel scales."""
    from common.models.fp8 import quantize_rows
    from common.models.moe import Experts, Fp8Scales, MoeArgs, fused_experts

    x, gate_up, down, weights, ids = _case(9, 6, 3, 32, 48, torch.float32, True)
    args = MoeArgs(6, 3, 48, True, True, frozenset({0}), fp8=True)
    experts = Experts(args, 32, 6)
    (gate_up8, gate_up_scale), (down8, down_scale) = quantize_rows(gate_up), quantize_rows(down)
    for name, value in (
        ("gate_up_proj", gate_up8),
        ("down_proj", down8),
        ("gate_up_proj_scale", gate_up_scale),
        ("down_proj_scale", down_scale),
    ):
        getattr(experts, name).data = value
    want = fused_experts(x, gate_up8, down8, weights, ids, Fp8Scales(gate_up_scale, down_scale))
    dense = experts.dequantized(torch.float32)
    got = fused_moe(*(a.to(device) for a in (x, *dense, weights, ids))).cpu()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-6)
