"""Sharded layers (Megatron's split, vLLM's names). A column-parallel linear is a plain
``nn.Linear`` over this rank's output rows and needs no class: fused q|k|v is split by heads,
gate|up by intermediate rows, and the loader fills each rank's rows (``common/models/loader.py``).

```
x ─┬─ qkv rows of rank 0 ─ attention (its heads) ─ o_proj cols of rank 0 ─┐
   └─ qkv rows of rank 1 ─ attention (its heads) ─ o_proj cols of rank 1 ─┴─ all-reduce ─ + bias
```
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.parallel.group import TensorParallel


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_r @ W_r^T) + b``: input columns split over ranks; the bias (whole on
    every rank) is added once, after the sum."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Rows ``[begin, end)`` of the table on each rank; a token outside them contributes zeros,
    and the all-reduce sums the one rank that holds it (exact: the others add 0)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.begin, self.end = tp.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(self.end - self.begin, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.begin) | (ids >= self.end)
        local = (ids - self.begin).masked_fill(outside, 0)
        x = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)


class ParallelLMHead(nn.Module):
    """Vocabulary rows split like ``VocabParallelEmbedding`` (and tied to it when the model
    ties them); logits are gathered on rank 0 and cut to ``vocab_size`` (None on the others)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        begin, end = tp.vocab_range(vocab_size)
        self.weight = nn.Parameter(torch.empty(end - begin, dim))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.tp.gather_last_dim(F.linear(hidden, self.weight).float())
        return logits[:, : self.vocab_size] if logits is not None else None
