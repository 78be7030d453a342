"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router and ``E`` gated experts.

Each token's hidden state goes through a router linear ``(T, H) → (T, E)``, a softmax in fp32,
and its ``top_k`` experts; its output is the routing-weighted sum of those experts' SwiGLU MLPs.
The two architectures differ only in how the top-k weights are normalised and in which dtype
they are applied (transformers 5.24, ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``):

    Mixtral    softmax(fp32) → top-k → divide by their sum; weights stay fp32
    Qwen3-MoE  softmax(fp32) → top-k → divide by their sum only if ``norm_topk_prob``;
               weights cast to the model dtype

The experts' part, ``fused_experts``, is one function of plain tensors so that a fused kernel
can replace it (issue 30 item 2). Its plain-PyTorch form follows transformers' default
``grouped_mm`` experts path, op for op where it rounds:

    flat top-k ids (T k,) ── stable argsort ──▶ assignments grouped by expert
    rows = x[token of each assignment]                      (T k, H)
    per expert e with n_e > 0 rows: silu_and_mul(rows_e @ gate_up[e]ᵀ) @ down[e]ᵀ
    back to (token, slot) order                               (T, k, H)
    × routing weight (fp32 product for Mixtral), sum over the k slots, cast   (T, H)

so greedy decoding matches HF token for token (the CPU's path). The loop is over experts,
never tokens; the per-expert row counts are read on the host once per layer. On CUDA the
experts run as ``kernels/fused_moe.py``'s two Triton launches instead, the counts kept on the
device, so a MoE decode step can be captured in a CUDA graph. Under expert parallelism the
kernel (CUDA) or the plain path (CPU) runs over a rank's experts only (``SparseMoe``'s
``ep``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from common.models.preflight import MOE_ARCHITECTURES
from kernels import ops as _registered  # noqa: F401 - registers torch.ops.pdserve.*

if TYPE_CHECKING:
    from common.parallel.group import TensorParallel

_ops = torch.ops.pdserve


@dataclass(frozen=True)
class MoeArgs:
    """The parts of an HF ``config.json`` the sparse MLP reads."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (Qwen3-MoE: ``moe_intermediate_size``)
    renormalize: bool  # the top-k weights divided by their sum
    fp32_weights: bool  # True: the weights multiply in fp32 (Mixtral); False: in the model dtype
    sparse_layers: frozenset[int]  # the layers with experts; the others have the dense MLP

    @staticmethod
    def from_hf(cfg: dict[str, Any], arch: str) -> MoeArgs | None:
        """None for a dense architecture."""
        if arch not in MOE_ARCHITECTURES:
            return None
        layers = range(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        if arch == "MixtralForCausalLM":
            return MoeArgs(
                num_experts=experts,
                top_k=cfg.get("num_experts_per_tok", 2),
                intermediate_size=cfg["intermediate_size"],
                renormalize=True,
                fp32_weights=True,
                sparse_layers=frozenset(layers),
            )
        dense = set(cfg.get("mlp_only_layers") or ())
        step = cfg.get("decoder_sparse_step", 1)
        sparse = [i for i in layers if i not in dense and experts > 0 and (i + 1) % step == 0]
        return MoeArgs(
            num_experts=experts,
            top_k=cfg.get("num_experts_per_tok", 8),
            intermediate_size=cfg["moe_intermediate_size"],
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            fp32_weights=False,
            sparse_layers=frozenset(sparse),
        )


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, E)`` router logits → (weights ``(T, k)`` in ``weights_dtype``, expert ids ``(T, k)``
    int64), highest probability first. Softmax and renormalisation in fp32, as HF."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # (T, E)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # (T, k)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if weights_dtype == torch.float32 else weights.to(weights_dtype)), ids


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``Σ_j w[t, j] · down[e] silu_and_mul(gate_up[e] x[t])`` over the ``k`` experts
    ``e = topk_ids[t, j]`` of each token; ``(T, H)`` in ``x``'s dtype.

    Shapes: ``x (T, H)``, ``gate_up (E, 2 I, H)`` (gate rows, then up rows), ``down (E, H, I)``,
    ``topk_weights (T, k)`` (fp32 or the model dtype: the product is taken in the wider one,
    summed over the k slots, then cast), ``topk_ids (T, k)`` int64. Mutates no input.
    """
    slots = expert_slots(x, gate_up, down, topk_ids, 0, gate_up.shape[0])
    return combine_slots(slots, topk_weights, x.dtype)


def expert_slots(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    first: int,
    num_experts: int,
) -> torch.Tensor:
    """Each (token, slot)'s expert output ``(T, k, H)``, for the slots whose expert is one of
    ``gate_up``/``down``'s (global ids ``first, first + 1, …``); the other slots are zero (an
    expert-parallel rank's share: the ranks' shares add up exactly, each slot being nonzero on
    one rank only). ``num_experts``: the model's, for the routing ids."""
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
            [_expert_mlp(g, gate_up[e], down[e]) for e, g in enumerate(groups) if local[e]]
        )  # (n, H), still grouped by expert
        slots.index_copy_(0, mine, out)
    return slots.view(num_tokens, k, -1)


def combine_slots(
    slots: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The routing-weighted sum over the k slots ``(T, k, H) → (T, H)``, cast to ``dtype``."""
    summed = (slots * topk_weights.unsqueeze(-1)).sum(dim=1)  # (T, H)
    return summed if summed.dtype == dtype else summed.to(dtype)


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP over its rows ``(n, H) → (n, H)``."""
    return F.linear(_ops.silu_and_mul(F.linear(x, gate_up)), down)


class SparseMoe(nn.Module):
    """The MoE MLP of one decoder layer: ``forward(x (T, H)) → (T, H)``.

    ``gate``: the router ``(E, H)``; ``experts.gate_up_proj (E, 2 I, H)`` and
    ``experts.down_proj (E, H, I)`` as transformers 5 holds them (the loader also fills them
    from per-expert checkpoints). ``ep``: the tensor-parallel group its experts are sharded
    over (expert parallelism): this rank holds experts ``ep.split(E)``, whole; every rank
    routes every token (the router is replicated and its input identical on all ranks), fills
    the slots of its own experts and one all-reduce of the ``(T, k, H)`` slots gives every rank
    all of them, exactly (each slot is nonzero on one rank), before the same weighted sum as
    on one device."""

    def __init__(self, args: MoeArgs, hidden_size: int, ep: TensorParallel | None = None) -> None:
        super().__init__()
        self.num_experts = args.num_experts
        self.first, last = ep.split(args.num_experts) if ep is not None else (0, args.num_experts)
        self.ep = ep
        self.gate = nn.Linear(hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args, hidden_size, last - self.first)
        self.top_k, self.renormalize = args.top_k, args.renormalize
        self.fp32_weights = args.fp32_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (T, E) in the model dtype
        dtype = torch.float32 if self.fp32_weights else logits.dtype
        weights, ids = route(logits, self.top_k, self.renormalize, dtype)
        if self.ep is None:
            return self.experts(x, weights, ids)
        if x.is_cuda:  # the fused kernel over this rank's experts, summed across the ranks
            return self.experts(x, weights, ids, self.first, self.ep.all_reduce)
        slots = self.experts.slots(x, ids, self.first, self.num_experts)
        return combine_slots(self.ep.all_reduce(slots), weights, x.dtype)


class Experts(nn.Module):
    """The stacked expert weights; ``forward`` is ``fused_experts`` over them."""

    def __init__(self, args: MoeArgs, hidden_size: int, num_local: int) -> None:
        super().__init__()
        inter = args.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_local, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_local, hidden_size, inter))

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        first: int = 0,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The experts' weighted sum. On CUDA ``kernels/fused_moe.py`` (nothing read on the
        host: capturable), where ``first``/``all_reduce`` make it an expert-parallel rank's
        share summed across the group; on the CPU the plain, HF-exact path (one device)."""
        if x.is_cuda:
            from kernels.fused_moe import fused_moe

            return fused_moe(
                x.contiguous(), self.gate_up_proj, self.down_proj, weights, ids,
                first_expert=first, all_reduce=all_reduce,
            )  # fmt: skip
        assert all_reduce is None, "expert parallelism on the CPU goes through slots()"
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)

    def slots(
        self, x: torch.Tensor, ids: torch.Tensor, first: int, num_experts: int
    ) -> torch.Tensor:
        """``expert_slots`` of this rank's experts (global ids from ``first``); the CPU's
        expert-parallel path (it reads the expert counts on the host)."""
        return expert_slots(x, self.gate_up_proj, self.down_proj, ids, first, num_experts)
