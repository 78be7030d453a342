"""What every attention layer of one step reads (``AttentionMetadata``) and the connector's
per-layer hooks, below both the backends (``common/attention.py``) and the row-kind planner
(``common/attention_plan.py``) that read them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import accumulate
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from common.lora.batch import LoraBatch


class LayerHooks(Protocol):
    """Per-layer callbacks of the KV connector (layer-wise load and save)."""

    def before_layer(self, layer: int) -> None: ...

    def after_layer(self, layer: int, kv_layer: torch.Tensor) -> None: ...


@dataclass
class AttentionMetadata:
    """Inputs of every attention layer for one flat mixed batch of ``S`` sequences, ``T`` tokens.

    Device tensors: ``query_start_loc (S+1,) int32``, ``seq_lens (S,) int32``,
    ``block_tables (S, max_blocks) int32`` (padded with 0), ``slot_mapping (T,) int64``
    (-1 = do not write). Host lists ``query_lens``/``seq_lens_cpu`` serve the torch path.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    hooks: LayerHooks | None = None
    # the step's LoRA rows (``common/lora/batch.py``): None when no row has an adapter
    lora: LoraBatch | None = None
    # What a backend derives once per step for all layers (its row split, index tensors).
    step_cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @cached_property
    def query_starts_cpu(self) -> list[int]:
        """Host copy of ``query_start_loc[:-1]``, computed once per step for every layer."""
        return [0, *accumulate(self.query_lens)][:-1]
