"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router and ``E`` gated experts.

Each token's hidden state goes through a router linear ``(T, H) → (T, E)``, a softmax in fp32,
and its ``top_k`` experts; its output is the routing-weighted sum of those experts' SwiGLU MLPs.
The two architectures differ only in how the top-k weights are normalised and in which dtype
they are applied (transformers 5.24, ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``):

    Mixtral    softmax(fp32) → top-k → divide by their sum; weights stay fp32
    Qwen3-MoE  softmax(fp32) → top-k → divide by their sum only if ``norm_topk_prob``;
               weights cast to the model dtype

On the CPU, a decode-sized step (``T k ≤ GATHER_MAX_ASSIGNMENTS`` = 64 (token, expert)
assignments) on one device with experts in the model dtype runs the whole sparse MLP, router to
weighted sum, as **one native call** (``torch.ops.pdserve.moe_decode``, ``kernels/moe_cpu.py``):
the gathered path below, at its rounding points, summed in the kernel's order. A MoE layer's
decode step is then 8 ops, as a dense layer's 10 (``tests/engine/test_step_ops.py``).

Otherwise the router and routing run in PyTorch and the experts' part, ``fused_experts``
(``common/models/moe_experts.py``, one function of plain tensors), takes one of two paths by
``T k``:

- **gathered** (``T k ≤ GATHER_MAX_ASSIGNMENTS`` = 64: decode steps, short prefills): each
  assignment's expert weights are gathered, ``gate_up[ids] (T, k, 2 I, H)``, and the experts
  run as batched matmuls:

      h   = einsum(gate_up[ids], x)                        (T, k, 2 I)
      act = silu_and_mul(h)                                (T k, I)
      out = einsum(down[ids], act, weights)                (T, H): Σ_j w_j · down[e_j] act_j

  a fixed op count whatever the experts hit (12 for Mixtral and Qwen3-MoE with
  ``norm_topk_prob``, 10 without, router included: ``tests/engine/test_moe_models.py``) and no
  host read; FP8 experts and expert-parallel ranks take it at decode sizes. It copies ``T k`` experts' weights, which is why it stops at 64 assignments. Its
  GEMMs are batched matrix-vector products, not HF's grouped GEMMs: results agree with the
  grouped path to fp32 reassociation (greedy output still equals HF's on the tiny and hold-out
  models, ``tests/engine/test_moe_models.py``);
- **grouped** (larger ``T k``: prefill), transformers' default ``grouped_mm`` experts path,
  op for op where it rounds:

      flat top-k ids (T k,) ── stable argsort ──▶ assignments grouped by expert
      rows = x[token of each assignment]                      (T k, H)
      per expert e with n_e > 0 rows: silu_and_mul(rows_e @ gate_up[e]ᵀ) @ down[e]ᵀ
      back to (token, slot) order                               (T, k, H)
      × routing weight (fp32 product for Mixtral), sum over the k slots, cast   (T, H)

  bit-equal to HF's block in fp32 and bf16; the loop is over experts, never tokens, and the
  per-expert row counts are read on the host once per layer (20 ops + 5 per expert hit).

On CUDA the experts run as ``kernels/fused_moe.py``'s two Triton launches instead, the counts
kept on the device, so a MoE decode step can be captured in a CUDA graph. Under expert
parallelism the kernel (CUDA) or the PyTorch path (``gathered_slots`` / ``expert_slots``)
runs over a rank's experts only (``SparseMoe``'s ``ep``): the ranks' summed slots are that
path's one-device result, bit for bit (and the native call's to fp32 reassociation).

FP8 experts (an FP8 checkpoint, or ``--quantization fp8``): ``gate_up_proj``/``down_proj`` in
e4m3 with ``gate_up_proj_scale (E, 2 I, n)``/``down_proj_scale (E, H, n)`` fp32, ``n = 1``
(per-channel; a per-tensor scale fills its rows) or one per block of columns (block-wise,
``common/models/fp8_blocks.py``). Both CPU paths dequantize only the experts they use (the
gathered weights, or each hit expert) to the model dtype, then compute as above; on CUDA the
rank's experts are dequantized before the kernel (correctness first: it holds one layer's
experts in the model dtype for the call).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from common.models.fp8 import FP8, checkpoint_quantization, dequantize, quantize_rows
from common.models.moe_experts import (
    GATHER_MAX_ASSIGNMENTS,
    Fp8Scales,
    combine_gathered,
    combine_slots,
    expert_slots,
    fused_experts,
    gathered_slots,
)
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
    fp8: bool = False  # an FP8 checkpoint: the experts' weights are e4m3 with fp32 scales

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
                fp8=checkpoint_quantization(cfg) == "fp8",
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
            fp8=checkpoint_quantization(cfg) == "fp8",
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
        if self._one_native_call(x):  # a CPU decode step: router to weighted sum, one op
            gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
            return _ops.moe_decode(x, self.gate.weight, gate_up, down, self.top_k,
                                   self.renormalize, self.fp32_weights)  # fmt: skip
        logits = self.gate(x)  # (T, E) in the model dtype
        dtype = torch.float32 if self.fp32_weights else logits.dtype
        weights, ids = route(logits, self.top_k, self.renormalize, dtype)
        if self.ep is None:
            return self.experts(x, weights, ids)
        if x.is_cuda:  # the fused kernel over this rank's experts, summed across the ranks
            return self.experts(x, weights, ids, self.first, self.ep.all_reduce)
        slots = self.experts.slots(x, ids, self.first, self.num_experts)
        if ids.numel() <= GATHER_MAX_ASSIGNMENTS:  # the one-device path's rounding, split
            return combine_gathered(self.ep.all_reduce(slots), weights, x.dtype)
        return combine_slots(self.ep.all_reduce(slots), weights, x.dtype)

    def _one_native_call(self, x: torch.Tensor) -> bool:
        """The CPU's decode-sized steps on one device with model-dtype experts go through
        ``kernels/moe_cpu.py`` (the gathered path's rounding, in one call)."""
        return (
            not x.is_cuda
            and self.ep is None
            and self.experts.scales is None
            and x.shape[0] * self.top_k <= GATHER_MAX_ASSIGNMENTS
            and x.dtype in (torch.float32, torch.bfloat16)
        )


class Experts(nn.Module):
    """The stacked expert weights; ``forward`` is ``fused_experts`` over them.

    FP8 (``args.fp8``, or ``quantize_fp8`` after loading): ``gate_up_proj``/``down_proj`` e4m3
    and ``gate_up_proj_scale (n, 2 I, 1)``/``down_proj_scale (n, H, 1)`` fp32, one scale per
    expert and output row; ``use_block_scales`` makes them one per ``block`` columns of each
    row (block-wise checkpoints)."""

    def __init__(self, args: MoeArgs, hidden_size: int, num_local: int) -> None:
        super().__init__()
        inter = args.intermediate_size
        dtype = FP8 if args.fp8 else None
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_local, 2 * inter, hidden_size, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_local, hidden_size, inter, dtype=dtype), requires_grad=False
        )
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None
        self.block: int | None = None
        if args.fp8:
            self.gate_up_proj_scale = nn.Parameter(torch.empty(num_local, 2 * inter, 1))
            self.down_proj_scale = nn.Parameter(torch.empty(num_local, hidden_size, 1))
            self.KEEP_DTYPE = ("gate_up_proj", "down_proj", "gate_up_proj_scale", "down_proj_scale")

    def use_block_scales(self, block: int) -> None:
        """One scale per ``block`` input columns of each row (before ``materialize``)."""
        self.block = block
        for name, weight in (("gate_up_proj_scale", self.gate_up_proj),
                             ("down_proj_scale", self.down_proj)):  # fmt: skip
            shape = (*weight.shape[:2], -(-weight.shape[2] // block))
            setattr(self, name, nn.Parameter(torch.empty(shape, device=weight.device)))

    @property
    def scales(self) -> Fp8Scales | None:
        """The FP8 scales, None for weights in the model dtype."""
        if self.gate_up_proj_scale is None or self.down_proj_scale is None:
            return None
        return Fp8Scales(self.gate_up_proj_scale, self.down_proj_scale, self.block)

    def quantize_fp8(self) -> int:
        """``--quantization fp8``: the loaded weights to e4m3 in place, one scale per expert and
        output row (a per-channel FP8 checkpoint's bytes), one expert at a time; 1 (done) or 0
        (already FP8)."""
        if self.scales is not None:
            return 0
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(self, name).data
            w8 = torch.empty(weight.shape, dtype=FP8, device=weight.device)
            scale = torch.empty(*weight.shape[:2], 1, device=weight.device)
            for e in range(weight.shape[0]):
                w8[e], scale[e] = quantize_rows(weight[e])
            setattr(self, name, nn.Parameter(w8, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
        return 1

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
        share summed across the group; on the CPU ``fused_experts`` (one device)."""
        if x.is_cuda:
            from kernels.fused_moe import fused_moe

            gate_up, down = self.dequantized(x.dtype)
            return fused_moe(
                x.contiguous(), gate_up, down, weights, ids,
                first_expert=first, all_reduce=all_reduce,
            )  # fmt: skip
        assert all_reduce is None, "expert parallelism on the CPU goes through slots()"
        return fused_experts(x, self.gate_up_proj, self.down_proj, weights, ids, self.scales)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up, down)`` in ``dtype``: the parameters themselves, or for FP8 experts all of
        this rank's experts dequantized (the CUDA kernel's input: a copy for the call)."""
        scales = self.scales
        if scales is None:
            return self.gate_up_proj, self.down_proj
        return (
            dequantize(self.gate_up_proj, scales.gate_up, scales.block, dtype),
            dequantize(self.down_proj, scales.down, scales.block, dtype),
        )

    def slots(
        self, x: torch.Tensor, ids: torch.Tensor, first: int, num_experts: int
    ) -> torch.Tensor:
        """This rank's experts' slots (global ids from ``first``), the CPU's expert-parallel
        path: ``gathered_slots`` up to ``GATHER_MAX_ASSIGNMENTS`` assignments (as one device
        computes them), else ``expert_slots`` (it reads the expert counts on the host)."""
        args = (x, self.gate_up_proj, self.down_proj, ids)
        if ids.numel() <= GATHER_MAX_ASSIGNMENTS:
            return gathered_slots(*args, first, self.scales)
        return expert_slots(*args, first, num_experts, self.scales)
