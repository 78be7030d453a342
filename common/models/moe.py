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

so greedy decoding matches HF token for token. The loop is over experts, never tokens; the
per-expert row counts are read on the host once per layer (a sync on a GPU, and why this path
cannot be captured in a CUDA graph: the fused kernel keeps the counts on the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.models.preflight import MOE_ARCHITECTURES
from kernels import ops as _registered  # noqa: F401 - registers torch.ops.pdserve.*

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
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.flatten()  # (T k,) assignment t k + j
    order = torch.argsort(flat_ids, stable=True)  # assignments grouped by expert
    rows = x[order // k]  # (T k, H) each assignment's token
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()  # host read
    groups = rows.split(counts)  # (n_e, H) each
    out = torch.cat(
        [_expert_mlp(g, gate_up[e], down[e]) for e, g in enumerate(groups) if counts[e]]
    )  # (T k, H), still grouped by expert
    slots = torch.empty_like(out).index_copy_(0, order, out).view(num_tokens, k, -1)  # (T, k, H)
    summed = (slots * topk_weights.unsqueeze(-1)).sum(dim=1)  # (T, H)
    return summed if summed.dtype == x.dtype else summed.to(x.dtype)


def _expert_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU MLP over its rows ``(n, H) → (n, H)``."""
    return F.linear(_ops.silu_and_mul(F.linear(x, gate_up)), down)


class SparseMoe(nn.Module):
    """The MoE MLP of one decoder layer: ``forward(x (T, H)) → (T, H)``.

    ``gate``: the router ``(E, H)``; ``experts.gate_up_proj (E, 2 I, H)`` and
    ``experts.down_proj (E, H, I)`` as transformers 5 holds them (the loader also fills them
    from per-expert checkpoints)."""

    def __init__(self, args: MoeArgs, hidden_size: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, args.num_experts, bias=False)
        self.experts = Experts(args, hidden_size)
        self.top_k, self.renormalize = args.top_k, args.renormalize
        self.fp32_weights = args.fp32_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (T, E) in the model dtype
        dtype = torch.float32 if self.fp32_weights else logits.dtype
        weights, ids = route(logits, self.top_k, self.renormalize, dtype)
        return self.experts(x, weights, ids)


class Experts(nn.Module):
    """The stacked expert weights; ``forward`` is ``fused_experts`` over them."""

    def __init__(self, args: MoeArgs, hidden_size: int) -> None:
        super().__init__()
        e, inter = args.num_experts, args.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the plain MoE path reads expert counts on the host and cannot be captured in a"
                " CUDA graph: run with enforce_eager=True"
            )
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids)
