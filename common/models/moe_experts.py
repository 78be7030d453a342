"""The experts of a sparse MoE layer as plain tensors (``common/models/moe.py``'s CPU paths,
and the reference of ``kernels/fused_moe.py``): gathered for small steps, grouped by expert for
large ones; the module docstring of ``moe.py`` says when and why each, and how they round."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from common.models.fp8 import dequantize
from kernels import ops as _registered  # noqa: F401 - registers torch.ops.pdserve.*

_ops = torch.ops.pdserve
GATHER_MAX_ASSIGNMENTS = 64  # T·k up to this: the gathered path (see moe.py's docstring)


class Fp8Scales(NamedTuple):
    """The fp32 scales of FP8 experts (``dequantize``'s): ``gate_up (E, 2 I, n)``,
    ``down (E, H, n)``; ``block``: columns per scale when ``n > 1`` (block-wise), else None."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: int | None = None


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: Fp8Scales | None = None,
) -> torch.Tensor:
    """``Σ_j w[t, j] · down[e] silu_and_mul(gate_up[e] x[t])`` over the ``k`` experts
    ``e = topk_ids[t, j]`` of each token; ``(T, H)`` in ``x``'s dtype.

    Shapes: ``x (T, H)``, ``gate_up (E, 2 I, H)`` (gate rows, then up rows), ``down (E, H, I)``,
    ``topk_weights (T, k)`` (fp32 or the model dtype: the product is taken in the wider one,
    summed over the k slots, then cast), ``topk_ids (T, k)`` int64; ``scales``: the weights are
    e4m3 (dequantized to ``x``'s dtype as they are used). The gathered path up to
    ``GATHER_MAX_ASSIGNMENTS`` assignments, else the grouped one. Mutates no input."""
    if topk_ids.numel() <= GATHER_MAX_ASSIGNMENTS:
        return gathered_experts(x, gate_up, down, topk_weights, topk_ids, scales)
    slots = expert_slots(x, gate_up, down, topk_ids, 0, gate_up.shape[0], scales)
    return combine_slots(slots, topk_weights, x.dtype)


def gathered_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    scales: Fp8Scales | None = None,
) -> torch.Tensor:
    """``fused_experts`` by gathering each assignment's expert weights and batched matmuls:
    7 ops (10 with routing weights in fp32 and ``x`` not; FP8 experts add their
    dequantization), none reading the device on the host."""
    act, w_down = _gathered_rows(x, gate_up, down, topk_ids, scales)
    if topk_weights.dtype == x.dtype:  # each expert's output, then the weighted sum over k
        # the contraction order pinned (opt_einsum, where installed, would pick by the shapes):
        # the two einsums of ``gathered_slots`` + ``combine_gathered``, bit for bit
        operands = [w_down, act, topk_weights]
        return torch.ops.aten.einsum("tkhi,tki,tk->th", operands, path=[0, 1, 0, 1])
    routed = torch.einsum("tkhi,tki->tkh", w_down, act)  # Mixtral in bf16: weights in fp32
    return combine_gathered(routed, topk_weights, x.dtype)


def gathered_slots(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    first: int,
    scales: Fp8Scales | None = None,
) -> torch.Tensor:
    """``expert_slots`` by the gathered path (an expert-parallel rank's share at decode
    sizes): each slot's expert output ``(T, k, H)`` for the experts ``first, …`` this rank
    holds, zero in the other slots (computed over a stand-in expert, then zeroed)."""
    local = topk_ids - first
    mine = (local >= 0) & (local < gate_up.shape[0])
    ids = local.clamp(0, gate_up.shape[0] - 1)
    act, w_down = _gathered_rows(x, gate_up, down, ids, scales)
    return torch.einsum("tkhi,tki->tkh", w_down, act) * mine.unsqueeze(-1)


def combine_gathered(
    slots: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The gathered path's weighted sum over the k slots ``(T, k, H) → (T, H)``, in the
    weights' dtype, cast to ``dtype``."""
    summed = torch.einsum("tkh,tk->th", slots.to(topk_weights.dtype), topk_weights)
    return summed if summed.dtype == dtype else summed.to(dtype)


def _gathered_rows(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    scales: Fp8Scales | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``silu_and_mul`` of each assignment's gate|up ``(T, k, I)``, its down weights
    ``(T, k, H, I)``), ``ids (T, k)`` indexing ``gate_up``/``down``."""
    num_tokens, k = ids.shape
    block = None if scales is None else scales.block
    w_gate_up = _gather(gate_up, None if scales is None else scales.gate_up, block, ids, x)
    h = torch.einsum("tkoh,th->tko", w_gate_up, x)  # (T, k, 2 I)
    act = _ops.silu_and_mul(h.view(num_tokens * k, -1)).view(num_tokens, k, -1)
    return act, _gather(down, None if scales is None else scales.down, block, ids, x)


def _gather(
    weights: torch.Tensor,
    scale: torch.Tensor | None,
    block: int | None,
    ids: torch.Tensor,
    like: torch.Tensor,
) -> torch.Tensor:
    """``weights[ids]``, dequantized to ``like``'s dtype when FP8 (``scale``)."""
    if scale is None:
        return weights[ids]
    return dequantize(weights[ids], scale[ids], block, like.dtype)


def expert_slots(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    first: int,
    num_experts: int,
    scales: Fp8Scales | None = None,
) -> torch.Tensor:
    """Each (token, slot)'s expert output ``(T, k, H)``, for the slots whose expert is one of
    ``gate_up``/``down``'s (global ids ``first, first + 1, …``); the other slots are zero (an
    expert-parallel rank's share: the ranks' shares add up exactly, each slot being nonzero on
    one rank only). ``num_experts``: the model's, for the routing ids. The grouped path."""
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.flatten()  # (T k,) assignment t k + j
    order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()  # host read
    local = counts[first : first + gate_up.shape[0]]
    begin, num_mine = sum(counts[:first]), sum(local)
    whole = num_mine == num_tokens * k
    # this rank's assignments, grouped by expert (all of them on one device)
    mine = order if whole else order[begin : begin + num_mine]
    slots = (
        x.new_empty(num_tokens * k, x.shape[1])
        if whole
        else x.new_zeros(num_tokens * k, x.shape[1])
    )
    if num_mine:
        groups = x[mine // k].split(local)  # (n_e, H) each
        out = torch.cat(
            [
                _expert_mlp(g, *_expert(gate_up, down, e, scales, x.dtype))
                for e, g in enumerate(groups)
                if local[e]
            ]
        )  # (n, H), still grouped by expert
        slots.index_copy_(0, mine, out)
    return slots.view(num_tokens, k, -1)


def _expert(
    gate_up: torch.Tensor, down: torch.Tensor, e: int, scales: Fp8Scales | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e``'s weights in ``dtype`` (dequantized when FP8)."""
    if scales is None:
        return gate_up[e], down[e]
    return (
        dequantize(gate_up[e], scales.gate_up[e], scales.block, dtype),
        dequantize(down[e], scales.down[e], scales.block, dtype),
    )


def combine_slots(
    slots: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The routing-weighted sum over the k slots ``(T, k, H) → (T, H)``, cast to ``dtype``."""
    summed = (slots * topk_weights.unsqueeze(-1)).sum(dim=1)  # (T, H)
    return summed if summed.dtype == dtype else summed.to(dtype)


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP over its rows ``(n, H) → (n, H)``."""
    return F.linear(_ops.silu_and_mul(F.linear(x, gate_up)), down)
