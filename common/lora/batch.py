"""One step's LoRA rows and the deltas added to each projection's output.

Built once per step from each row's adapter slot (-1: the base model) and shared by every
layer, as the attention metadata is. ``apply(layer, proj, x, y)`` adds every row's adapter
delta to the projection's output ``y`` in place: ``y[t] += (x[t] A[slot]ᵀ) B[slot]ᵀ``.

- CUDA: two Triton launches per projection (``kernels/lora.py``: shrink, expand) over tiles of
  rows grouped by adapter, so each tile reads its adapter's weights once; nothing is read on the
  host during the forward.
- CPU: one adapter with every row: two GEMMs over the batch. Several adapters in a step whose
  rows pad to one length with little waste (decode): every slot's rows gathered into one
  ``(S, L, K)`` batch, two batched GEMMs, one scatter-add — nine dispatched ops (four of
  them views) whatever the adapters. Else
  (a long prompt chunk beside a few decodes): two GEMMs per adapter present (≤ ``max_loras``,
  never per request) over its gathered rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class LoraBatch:
    """The step's rows per adapter slot. ``a``/``b``: the manager's slot tensors."""

    def __init__(
        self,
        token_slots: Sequence[int] | np.ndarray,
        a: dict[tuple[int, str], torch.Tensor],
        b: dict[tuple[int, str], torch.Tensor],
        kernels: bool,
    ) -> None:
        """``kernels``: apply with ``kernels/lora.py`` (CUDA; tests run it interpreted on the
        CPU), else with the CPU's grouped GEMMs."""
        self.a, self.b = a, b
        self.num_tokens = len(token_slots)
        self.kernels = kernels
        if kernels:
            from kernels.lora import lora_tiles

            device = next(iter(a.values())).device
            sorted_tokens, tiles = lora_tiles(token_slots)
            self.sorted_tokens = sorted_tokens.to(device, non_blocking=True)
            self.tiles = tiles.to(device, non_blocking=True)
            return
        # CPU: (slot, rows) per adapter present (numpy, no loop over rows); rows None when it
        # has every row of the step
        slots = np.asarray(token_slots, dtype=np.int64)
        by_slot = {int(s): np.flatnonzero(slots == s) for s in np.unique(slots[slots >= 0])}
        self.groups = [
            (slot, None if len(rows) == self.num_tokens else torch.from_numpy(rows))
            for slot, rows in by_slot.items()
        ]
        self.padded = self._padded_groups(by_slot, next(iter(a.values())).shape[0])

    def _padded_groups(
        self, by_slot: dict[int, np.ndarray], num_slots: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """When several adapters share the step and padding them to one length wastes little
        (decode steps): ``(gather (S, L), scatter (S L,))`` row indices, every slot's rows
        padded to the longest with a zero row (``T``) gathered and row 0 scattered to (adding
        zeros), so a projection's deltas are two batched GEMMs over every slot at once."""
        if len(by_slot) < 2:
            return None
        longest = max(len(rows) for rows in by_slot.values())
        if num_slots * longest > 2 * sum(len(rows) for rows in by_slot.values()):
            return None  # unbalanced (a prompt chunk beside decodes): one GEMM pair per adapter
        gather = torch.full((num_slots, longest), self.num_tokens, dtype=torch.long)
        for slot, rows in by_slot.items():
            gather[slot, : len(rows)] = torch.from_numpy(rows)
        return gather, torch.where(gather == self.num_tokens, 0, gather).flatten()

    def apply(self, layer: int, proj: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y (T, N) += delta(x (T, K))`` for the rows with an adapter; other rows untouched.
        A projection no adapter may target (a MoE layer's MLP) is left alone."""
        a = self.a.get((layer, proj))
        if a is None:
            return
        b = self.b[layer, proj]
        if self.kernels:
            from kernels.lora import lora_expand, lora_shrink

            s = x.new_empty(x.shape[0], a.shape[1])
            lora_shrink(x, a, self.sorted_tokens, self.tiles, s)
            lora_expand(s, b, self.sorted_tokens, self.tiles, y)
            return
        if self.padded is not None:
            gather, scatter = self.padded
            rows = torch.cat((x, x.new_zeros(1, x.shape[1])))[gather]  # (S, L, K)
            delta = torch.bmm(torch.bmm(rows, a.transpose(1, 2)), b.transpose(1, 2))  # (S, L, N)
            y.index_add_(0, scatter, delta.flatten(0, 1))
            return
        for slot, rows in self.groups:
            if rows is None:
                y += (x @ a[slot].T) @ b[slot].T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot].T)


class GraphLoraBatch(LoraBatch):
    """The kernel path over fixed device buffers, for CUDA graphs: captured once with every
    tile a padding one, refilled with a step's rows before each replay (``refill``, copies
    ordered on the stream after the step before it, as the other input buffers are)."""

    def __init__(
        self,
        a: dict[tuple[int, str], torch.Tensor],
        b: dict[tuple[int, str], torch.Tensor],
        max_rows: int,
        max_slots: int,
    ) -> None:
        from kernels.lora import max_lora_tiles

        self.a, self.b, self.kernels = a, b, True
        self.num_tokens = max_rows
        device = next(iter(a.values())).device
        self.max_tiles = max_lora_tiles(max_rows, max_slots)
        self.sorted_tokens = torch.zeros(max(1, max_rows), dtype=torch.int32, device=device)
        padding = torch.tensor([[0, 0, -1]], dtype=torch.int32)
        self.tiles = padding.repeat(self.max_tiles, 1).to(device)

    def refill(self, token_slots: Sequence[int] | np.ndarray) -> None:
        """The rows of the step about to be replayed (padding rows: none, -1)."""
        from kernels.lora import lora_tiles

        sorted_tokens, tiles = lora_tiles(token_slots, pad_tiles=self.max_tiles)
        self.sorted_tokens[: len(sorted_tokens)].copy_(sorted_tokens, non_blocking=True)
        self.tiles.copy_(tiles, non_blocking=True)
