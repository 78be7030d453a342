"""Block-wise FP8 scales (DeepSeek-V3 / Qwen3-FP8 checkpoints): one fp32 scale per
``(rows, columns)`` block of a weight, ``quantization_config.weight_block_size`` (128×128 in
practice), stored as ``weight_scale_inv`` (despite the name, the multiplier: ``w = w8 · s``).

How the model holds them: a checkpoint's grid ``(⌈out / rows⌉, ⌈in / columns⌉)`` is expanded
along its rows at load (:func:`expand_rows`), so a projection keeps ``weight_scale (out, ⌈in /
columns⌉)``: each output row its own blocks' scales. Rows then split and fuse freely (q|k|v and
gate|up shards of any size; one expert's rows of a stacked tensor), at ``4 / columns`` bytes a
weight (3 % of the FP8 weight at 128 columns). Per-channel scales are the case of one block of
columns (``weight_scale (out, 1)``).

How they compute: ``common.models.fp8.dequantize`` (the product in fp32, rounded once to the
model dtype), then the model-dtype GEMM: ``Fp8Linear`` per call, the MoE experts on the rows
they gather (``common/models/moe.py``). The same on the CPU and on CUDA, a correctness-first
fallback: the weights stay FP8 in memory, the arithmetic is the model dtype's (W8A16), and a
call pays one dequantization of its weight. Not yet: a block-scaled GEMM (``torch._scaled_mm``
with 1×128 activation and 128×128 weight scales on sm_90, DeepGEMM) and tensor parallelism
(the grid's rows and columns would have to split on block boundaries; refused in one line).
"""

from __future__ import annotations

import torch
from torch import nn

from common.models.fp8 import FP8, FP8_MAX

_MIN_SCALE = 1e-12


def use_block_scales(model: nn.Module, columns: int) -> int:
    """Give every FP8 projection and FP8 expert stack of a model built on ``meta`` one scale
    per ``columns`` input columns of each row (``use_block_scales`` of each module, before
    ``materialize``); returns how many modules."""
    done = 0
    for module in model.modules():
        use = getattr(module, "use_block_scales", None)
        if use is not None and getattr(module, "KEEP_DTYPE", ()):
            use(columns)
            done += 1
    return done


def expand_rows(grid: torch.Tensor, rows: int, block_rows: int) -> torch.Tensor:
    """A checkpoint's scale grid ``(..., ⌈rows / block_rows⌉, n)`` → ``(..., rows, n)``: each
    row the scales of its block."""
    return grid.repeat_interleave(block_rows, dim=-2)[..., :rows, :]


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(..., out, in)`` → (e4m3 weights, fp32 grid ``(..., ⌈out / r⌉, ⌈in / c⌉)``), one scale
    per ``block = (r, c)`` block, ``max|w| / 448`` over it (how such checkpoints are written;
    for tests and benchmarks)."""
    r, c = block
    *lead, out, inn = w.shape
    pad = w.new_zeros(*lead, -(-out // r) * r, -(-inn // c) * c).float()
    pad[..., :out, :inn] = w.float()
    tiles = pad.unflatten(-1, (-1, c)).unflatten(-3, (-1, r))  # (..., R, r, C, c)
    grid = (tiles.abs().amax(dim=(-3, -1)) / FP8_MAX).clamp(min=_MIN_SCALE)  # (..., R, C)
    scaled = tiles / grid[..., :, None, :, None]
    w8 = scaled.clamp(-FP8_MAX, FP8_MAX).flatten(-4, -3).flatten(-2, -1)[..., :out, :inn]
    return w8.to(FP8).contiguous(), grid


def fit_scale(
    tensor: torch.Tensor, dst: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """A checkpoint's FP8 scale in ``dst``'s shape (the rows of its shard or expert): one per
    tensor ``()``/``(1,)`` fills them; one per expert of a stacked tensor ``(E,)``/``(E, 1, 1)``
    fills each expert's; per channel ``(…, out)``/``(…, out, 1)``; a block grid ``(…, ⌈out /
    r⌉, ⌈in / c⌉)`` has its rows expanded. Returned as is when none fits (a shape error)."""
    if tensor.numel() == 1:
        return tensor.reshape([1] * dst.dim()).expand(dst.shape)
    if tensor.numel() == dst.numel():
        return tensor.reshape(dst.shape)
    if dst.dim() == 3 and tensor.numel() == dst.shape[0]:
        return tensor.reshape(-1, 1, 1).expand(dst.shape)
    if block is not None and tensor.shape[-1] == dst.shape[-1]:
        grid = tensor.reshape(*dst.shape[:-2], -1, dst.shape[-1])
        if grid.shape[-2] == -(-dst.shape[-2] // block[0]):
            return expand_rows(grid, dst.shape[-2], block[0])
    return tensor
