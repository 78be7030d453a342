"""FP8 weights (e4m3): the decoder's projections as W8A8 GEMMs with per-output-channel weight
scales and dynamic per-token activation scales, vLLM's ``fp8`` scheme.

Two ways in:

- an FP8 checkpoint (``quantization_config.quant_method == "fp8"``, the layout vLLM's
  ``fp8`` and compressed-tensors' FP8 use): each projection's ``weight`` is float8_e4m3fn and
  ``weight_scale`` is one fp32 scale per tensor or per output channel; the model is built with
  ``Fp8Linear`` projections and the loader copies the fp8 bytes as they are (a per-tensor scale
  fills the rows of its shard of a fused projection, ``common/models/loader.py``). Static
  activation scales (``input_scale``) are not used: activations are scaled per token, always;
  block-wise checkpoints (``weight_block_size``, DeepSeek/Qwen3-FP8 style ``weight_scale_inv``
  per 128×128 block) load too: see ``common/models/fp8_blocks.py``;
- ``--quantization fp8`` over a bf16/fp32 checkpoint: it loads as usual, then every projection
  is quantized in place (``quantize_model``): per output channel, ``scale = max|w| / 448``.

A projection's forward: ``x`` per token to e4m3 (``scale = max|x| / 448``), then one
``torch._scaled_mm`` with the row-wise scales of both sides, output in ``x``'s dtype. Under
tensor parallelism a row-parallel projection (o_proj, down_proj) sees a slice of each token's
columns; its scale is the max over all slices (one all-reduce MAX of ``T`` floats, before the
GEMM), so TP quantizes exactly as one device does and gives its tokens. vLLM scales each
rank's slice on its own (no collective, different rounding per TP size); here correctness
across TP sizes wins the extra small collective per row-parallel projection. The same
call runs on the CPU (torch's reference kernel: the CPU proves the GPU's code path, not its
speed) and on CUDA (FP8 tensor cores on sm_89/sm_90; row-wise scaling needs sm_89+). The
router, the embeddings, the LM head and the norms stay in the model dtype (vLLM keeps the LM head
too). MoE experts hold FP8 weights with the same scales per expert and are dequantized to the
model dtype inside the experts' path (``common/models/moe.py``, :func:`dequantize`): weights
in FP8, arithmetic in the model dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from common.parallel.group import TensorParallel

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # of each decoder layer
_MIN_SCALE = 1e-12  # an all-zero row or token: any positive scale gives zeros


def checkpoint_quantization(hf_config: dict[str, Any]) -> str | None:
    """``"fp8"`` for an FP8 checkpoint (per-tensor, per-channel or block-wise scales), None for
    an unquantized one; ValueError for another method."""
    q = hf_config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method != "fp8":
        raise ValueError(f"unsupported quantization {method!r}: only fp8 checkpoints load")
    weight_block(hf_config)  # a malformed block size fails here, in one line
    return "fp8"


def weight_block(hf_config: dict[str, Any]) -> tuple[int, int] | None:
    """An FP8 checkpoint's ``weight_block_size`` ``(rows, columns)`` of one scale, or None
    (per-tensor or per-channel scales)."""
    block = (hf_config.get("quantization_config") or {}).get("weight_block_size")
    if not block:
        return None
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"weight_block_size {block!r}: expected two positive ints")
    return int(block[0]), int(block[1])


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(..., out, in)`` → (e4m3 weights, fp32 scales ``(..., out, 1)``), per output channel
    (of each expert, for a stacked ``(E, out, in)``)."""
    scale = (w.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=_MIN_SCALE)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(
    w8: torch.Tensor, scale: torch.Tensor, block: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """e4m3 ``(..., out, in)`` × its scales → ``dtype``: the product in fp32, rounded once.
    ``scale (..., out, 1)`` one per row (per-channel; a per-tensor scale fills its rows), or
    ``(..., out, ⌈in / block⌉)`` one per ``block`` columns of each row (block-wise scales with
    their rows expanded, ``common/models/fp8_blocks.py``)."""
    if block is not None and scale.shape[-1] > 1:
        scale = scale.repeat_interleave(block, dim=-1)[..., : w8.shape[-1]]
    return (w8.float() * scale).to(dtype)


def fp8_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    tp: TensorParallel | None = None,
) -> torch.Tensor:
    """``x @ (weight · scale)ᵀ`` with ``x`` quantized per token: ``(..., in) → (..., out)`` in
    ``x``'s dtype. ``tp``: ``x`` is this rank's slice of the input columns (a row-parallel
    projection): the token's scale is the largest ``|x|`` over every rank's slice, so each
    element rounds as on one device and the partial products sum to one device's result."""
    rows = x.reshape(-1, x.shape[-1])
    amax = rows.abs().amax(dim=1, keepdim=True).float()
    if tp is not None:
        amax = tp.all_reduce_max(amax)
    x_scale = (amax / FP8_MAX).clamp(min=_MIN_SCALE)
    x8 = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    y = torch._scaled_mm(
        x8, weight.t(), scale_a=x_scale, scale_b=weight_scale.t(), out_dtype=x.dtype
    )
    return y.view(*x.shape[:-1], weight.shape[0])


class Fp8Linear(nn.Module):
    """A projection in FP8: ``weight (out, in)`` e4m3, ``weight_scale (out, 1)`` fp32, the bias
    in the model dtype. ``tp``: a row-parallel projection (its input columns split over the
    ranks): the partial products are all-reduced, then the bias is added once.

    Block-wise (``block`` set by ``use_block_scales``): ``weight_scale (out, ⌈in / block⌉)``,
    the checkpoint's 2-D grid with its rows expanded (each row its blocks' scales, so fused
    shards and row slices need no alignment); forward dequantizes the weight to ``x``'s dtype
    and runs one ``F.linear`` (W8A16: no activation quantization), on the CPU and on CUDA
    alike (``common/models/fp8_blocks.py``)."""

    KEEP_DTYPE = ("weight", "weight_scale")  # ``materialize`` keeps these dtypes

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8))
        self.weight_scale = nn.Parameter(torch.empty(out_features, 1, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.block: int | None = None

    def use_block_scales(self, block: int) -> None:
        """Hold one scale per ``block`` input columns of each row (before ``materialize``)."""
        rows, cols = self.weight.shape
        self.block = block
        shape = (rows, -(-cols // block))
        self.weight_scale = nn.Parameter(self.weight_scale.new_empty(shape), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            w = dequantize(self.weight, self.weight_scale, self.block, x.dtype)
            y = torch.nn.functional.linear(x, w)
        else:
            y = fp8_matmul(x, self.weight, self.weight_scale, self.tp)
        if self.tp is not None:
            y = self.tp.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    @staticmethod
    def from_module(module: nn.Module) -> Fp8Linear:
        """An ``nn.Linear`` or ``RowParallelLinear`` quantized per output channel."""
        weight = module.weight.data
        tp = getattr(module, "tp", None)
        fp8 = Fp8Linear(weight.shape[1], weight.shape[0], module.bias is not None, tp)
        w8, scale = quantize_rows(weight)
        fp8.weight = nn.Parameter(w8, requires_grad=False)
        fp8.weight_scale = nn.Parameter(scale, requires_grad=False)
        if module.bias is not None:
            fp8.bias = nn.Parameter(module.bias.data, requires_grad=False)
        return fp8


def projection(
    in_features: int, out_features: int, bias: bool, fp8: bool, tp: TensorParallel | None = None
) -> nn.Module:
    """A decoder projection as the checkpoint holds it: ``Fp8Linear`` for an FP8 checkpoint,
    else ``nn.Linear`` (``tp``: row-parallel, ``RowParallelLinear``)."""
    if fp8:
        return Fp8Linear(in_features, out_features, bias, tp)
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    from common.parallel.layers import RowParallelLinear

    return RowParallelLinear(in_features, out_features, bias, tp)


def quantize_model(model: nn.Module) -> int:
    """Replace every decoder projection of a loaded model by its ``Fp8Linear`` and quantize
    MoE experts in place (``quantize_fp8``, per expert and output channel); returns how many
    projections and expert stacks. Each full-precision weight is released as its layer is
    done."""
    done = 0
    for module in list(model.modules()):
        quantize = getattr(module, "quantize_fp8", None)
        if quantize is not None:
            done += quantize()
        for name in PROJECTIONS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Module) and not isinstance(child, Fp8Linear):
                setattr(module, name, Fp8Linear.from_module(child))
                done += 1
    return done
