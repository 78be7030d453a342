"""The experts of a sparse MoE layer in two Triton launches (CUDA), after vLLM's ``fused_moe``.

```
topk_ids (T, k) ── moe_align ──▶ sorted_ids (P,)  assignments t·k + j grouped by expert, each
                                                  expert's run padded to BLOCK_M (pad: T·k)
                                 block_expert (P / BLOCK_M,)  the expert of each row block
launch 1, grid (blocks, I / BLOCK_N):  h[p] = silu(x[t] gate[e]ᵀ) * (x[t] up[e]ᵀ)   (P, I)
launch 2, grid (blocks, H / BLOCK_N):  out[a] = w[a] · h[p] down[e]ᵀ            (T·k, H)
(one kernel, ``_moe_gemm_kernel``, twice: ``GATE_UP`` picks the rows and the epilogue)
then Σ over the k slots of each token                                            (T, H)
```

Every size is fixed by ``T``, ``k`` and the expert count (``P = T·k + E·(BLOCK_M − 1)``
rounded up to ``BLOCK_M``): the expert counts stay on the device, nothing is read on the host,
so a MoE step can be captured in a CUDA graph (the plain path, ``common/models/moe.py``, reads
the counts on the host). A row block whose expert is the sentinel ``E`` (past every expert's
run) returns at once. Rounding follows the plain path's points: each projection's fp32
accumulator is rounded to the model dtype before ``silu_and_mul`` (computed in fp32, rounded),
and the routed product is taken in the weights' dtype (fp32 for Mixtral) before the sum;
the sum over a projection's inner dimension is the tile order's, so results agree with the plain
path to fp32 reassociation, not bit for bit (the CPU keeps the plain, HF-exact path).

:func:`ref_fused_moe` is the plain path (``common.models.moe.fused_experts``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from kernels._common import check, check_runnable, interpreted, tile_dot

BLOCK_M = 16  # assignments per row block (decode batches are small: few padded rows)


def moe_align(
    topk_ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_ids (P,) int64, block_expert (P / block_m,) int64)`` on ``topk_ids``' device,
    with device ops only (no host read): each expert's assignments in token order, its run
    padded to a multiple of ``block_m`` with ``T·k``; the expert of each row block, ``E`` for
    the blocks past the last run."""
    flat = topk_ids.flatten()
    n = flat.shape[0]
    size = triton.cdiv(n + num_experts * (block_m - 1), block_m) * block_m
    # (not bincount: its output size follows the largest id, read on the host)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    run_start = run_end - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in ``order``
    dest = run_start[expert] + torch.arange(n, device=flat.device) - first[expert]
    sorted_ids = torch.full((size,), n, dtype=torch.int64, device=flat.device)
    sorted_ids.index_copy_(0, dest, order)
    starts = torch.arange(0, size, block_m, device=flat.device)
    block_expert = torch.searchsorted(run_end, starts, right=True)  # E past the last run
    return sorted_ids, block_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr,  # GATE_UP: x (T, K); else h (P, K)
    w_ptr,  # GATE_UP: gate_up (E, 2 N, K), gate rows then up rows; else down (E, N, K)
    out_ptr,  # GATE_UP: h (P, N); else the routed outputs (T k, N)
    weights_ptr,  # (T k,) routing weights (read when not GATE_UP)
    sorted_ptr,  # (P,)
    block_expert_ptr,  # (P / BLOCK_M,)
    num_assignments,  # T k (the pad value)
    N,
    K,
    TOP_K: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    GATE_UP: tl.constexpr,  # the first GEMM (silu_and_mul after it) or the second (routed)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One (row block, column block) of an expert's GEMM over the assignments of the block."""
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    assignment = tl.load(sorted_ptr + rows)
    valid = assignment < num_assignments
    safe = tl.where(valid, assignment, 0).to(tl.int64)
    a_rows = safe // TOP_K if GATE_UP else rows.to(tl.int64)  # the token's x, or its h row
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = w_ptr + expert.to(tl.int64) * (2 if GATE_UP else 1) * N * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * K + ks[None, :], mask=valid[:, None] & k_ok[None, :],
                    other=0.0)  # fmt: skip
        b_mask = k_ok[:, None] & col_ok[None, :]
        b = tl.load(w + cols[None, :] * K + ks[:, None], mask=b_mask, other=0.0)
        acc += tile_dot(a, b, PRECISION, UPCAST)
        if GATE_UP:
            b_up = tl.load(w + (N + cols[None, :]) * K + ks[:, None], mask=b_mask, other=0.0)
            up += tile_dot(a, b_up, PRECISION, UPCAST)
    dtype = a_ptr.dtype.element_ty  # the model dtype: each projection's output rounds to it
    mask = valid[:, None] & col_ok[None, :]
    if GATE_UP:
        g = acc.to(dtype).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        h = act * up.to(dtype).to(tl.float32)
        tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], h.to(dtype), mask=mask)
    else:
        weight = tl.load(weights_ptr + safe, mask=valid, other=0.0).to(tl.float32)
        out_dtype = out_ptr.dtype.element_ty
        # the product in fp32, rounded once to the weights' dtype: torch's bf16 multiply
        routed = acc.to(dtype).to(out_dtype).to(tl.float32) * weight[:, None]
        tl.store(out_ptr + safe[:, None] * N + cols[None, :], routed.to(out_dtype), mask=mask)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    first_expert: int = 0,
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    block_n: int = 64,
    block_k: int = 32,
) -> torch.Tensor:
    """``Σ_j w[t, j] · down[e] silu_and_mul(gate_up[e] x[t])`` over each token's ``k``
    experts, ``(T, H)`` in ``x``'s dtype (the contract of ``common.models.moe.fused_experts``).

    Shapes: ``x (T, H)`` contiguous, ``gate_up (E, 2 I, H)`` and ``down (E, H, I)`` contiguous
    in ``x``'s dtype, ``topk_weights (T, k)`` fp32 or ``x``'s dtype, ``topk_ids (T, k)`` int64
    (not checked: it would read the device).

    Expert parallelism: ``gate_up``/``down`` hold experts ``first_expert, …`` of the model; the
    assignments to other experts go to a run of their own that no program computes, their
    routed rows stay zero, and ``all_reduce`` (the group's sum) fills them in from the other
    ranks before the sum over ``k`` — exactly, each row being nonzero on one rank."""
    check_runnable(_moe_gemm_kernel, x.device)
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter = two_inter // 2
    check(
        x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()
        and gate_up.shape[2] == hidden and down.shape == (num_experts, hidden, inter)
        and gate_up.dtype == down.dtype == x.dtype and topk_ids.shape == topk_weights.shape
        and topk_ids.dtype == torch.int64,
        f"fused_moe: x {tuple(x.shape)} {x.dtype}, gate_up {tuple(gate_up.shape)}, down "
        f"{tuple(down.shape)}, topk {tuple(topk_ids.shape)} {topk_ids.dtype}",
    )  # fmt: skip
    k = topk_ids.shape[1]
    ids = topk_ids
    if all_reduce is not None:  # another rank's experts: the extra expert ``num_experts``
        local = topk_ids - first_expert
        ids = local.masked_fill((local < 0) | (local >= num_experts), num_experts)
    sorted_ids, block_expert = moe_align(ids, num_experts + (all_reduce is not None))
    padded = sorted_ids.shape[0]
    h = x.new_empty(padded, inter)
    upcast = interpreted(_moe_gemm_kernel)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    blocks = padded // BLOCK_M
    weights = topk_weights.contiguous().view(-1)
    new = torch.empty if all_reduce is None else torch.zeros  # others' rows: zero until summed
    routed = new(num_tokens * k, hidden, dtype=weights.dtype, device=x.device)
    for gate_up_step, (a, w, out, n, inner) in enumerate(
        ((x, gate_up, h, inter, hidden), (h, down, routed, hidden, inter))
    ):
        _moe_gemm_kernel[(blocks, triton.cdiv(n, block_n))](
            a, w, out, weights, sorted_ids, block_expert, num_tokens * k, n, inner,
            TOP_K=k, NUM_EXPERTS=num_experts, GATE_UP=gate_up_step == 0, BLOCK_M=BLOCK_M,
            BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast,
        )  # fmt: skip
    if all_reduce is not None:
        routed = all_reduce(routed)
    summed = routed.view(num_tokens, k, hidden).sum(dim=1)
    return summed if summed.dtype == x.dtype else summed.to(x.dtype)


def ref_fused_moe(*args: torch.Tensor) -> torch.Tensor:
    """The CPU's path, ``common.models.moe.fused_experts`` (gathered up to 64 assignments,
    grouped and HF-exact beyond), on :func:`fused_moe`'s arguments. FP8 experts reach
    :func:`fused_moe` dequantized to the model dtype (``Experts.dequantized``)."""
    from common.models.moe import fused_experts

    return fused_experts(*args)
