"""The device's adapter slots: ``max_loras`` adapters resident at once, loaded from disk on
demand, the least recently used one out when a step needs another.

Every projection an adapter may target has two slot tensors allocated once, at start-up and
before the KV cache is sized (so the memory profile sees them)::

    a[layer, proj] (S, n·R, K)    b[layer, proj] (S, N, n·R)    S = max_loras, R = max_lora_rank

A step's adapters are put in slots (``activate``) before its forward; the scheduler admits no
more distinct adapters to a step than there are slots, so one step never evicts an adapter it
uses. Loading is a host read and one copy per projection, in the engine's thread, between steps'
forwards (vLLM loads where we do).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from common.lora.adapter import LoraRef, adapter_config
from common.lora.batch import GraphLoraBatch, LoraBatch
from common.lora.weights import ModelProjections, Projection, check_shapes, read_weights
from common.step_outputs import ScheduledRequest

logger = logging.getLogger(__name__)


def model_projections(model: nn.Module) -> ModelProjections:
    """The fused projections of a Llama-family model an adapter may target (a MoE layer's
    experts are not among them)."""
    from common.models.llama import MLP

    out: ModelProjections = {}
    for i, layer in enumerate(model.layers):  # type: ignore[union-attr, arg-type]
        attn, hidden = layer.self_attn, model.args.hidden_size  # type: ignore[union-attr]
        out[i, "qkv"] = Projection(hidden, (attn.q_size, attn.kv_size, attn.kv_size))
        out[i, "o"] = Projection(attn.q_size, (hidden,))
        if isinstance(layer.mlp, MLP):
            inter = model.args.intermediate_size  # type: ignore[union-attr]
            out[i, "gate_up"] = Projection(hidden, (inter, inter))
            out[i, "down"] = Projection(inter, (hidden,))
    return out


class LoraManager:
    """Slots of one model runner: ``activate`` puts a step's adapters in slots and gives each
    row's slot; ``batch`` (eager) and ``graph_batch`` (decode graphs) are what the forward
    reads. A slot is rewritten in stream order, after the steps already launched that read
    it (the overlapped loop may schedule the next step while one runs)."""

    def __init__(
        self, model: nn.Module, max_loras: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = dtype, device
        self.projections = model_projections(model)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for where, p in self.projections.items():
            n = len(p.slices) * max_rank
            self.a[where] = torch.zeros(max_loras, n, p.in_features, dtype=dtype, device=device)
            self.b[where] = torch.zeros(max_loras, p.out_features, n, dtype=dtype, device=device)
        self.resident: OrderedDict[str, int] = OrderedDict()  # identity → slot, LRU first
        self.num_loads = 0
        self._checked: set[str] = set()  # content hashes whose shapes fit
        self.kernels = device.type == "cuda"  # kernels/lora.py (tests: interpreted on a CPU)

    def check(self, lora: LoraRef) -> None:
        """ValueError unless the adapter fits this model and these slots (headers only)."""
        if lora.content_hash not in self._checked:
            config = adapter_config(lora.path, self.max_rank)
            check_shapes(lora.path, config, self.projections)
            self._checked.add(lora.content_hash)

    def activate(self, scheduled: list[ScheduledRequest]) -> np.ndarray | None:
        """Put the step's adapters in slots; each row's slot (-1: the base model; one entry
        per request, repeated over its rows), or None when no row has an adapter."""
        used: set[str] = set()
        slots = [-1 if s.request.lora is None else self._slot(s.request.lora, used)
                 for s in scheduled]  # fmt: skip
        if not used:
            return None
        return np.repeat(np.asarray(slots, dtype=np.int64), [s.num_new_tokens for s in scheduled])

    def batch(self, token_slots: np.ndarray) -> LoraBatch:
        """An eager step's LoRA rows."""
        return LoraBatch(token_slots, self.a, self.b, self.kernels)

    def graph_batch(self, max_rows: int) -> GraphLoraBatch:
        """Fixed buffers for captured steps of up to ``max_rows`` rows (the kernel path)."""
        return GraphLoraBatch(self.a, self.b, max_rows, self.max_loras)

    def _slot(self, lora: LoraRef, used: set[str]) -> int:
        """``lora``'s slot, loading it there if needed; ``used``: the step's adapters so far,
        never evicted for another of the same step."""
        used.add(lora.identity)
        slot = self.resident.get(lora.identity)
        if slot is not None:
            self.resident.move_to_end(lora.identity)
            return slot
        free = sorted(set(range(self.max_loras)) - set(self.resident.values()))
        if free:
            slot = free[0]
        else:
            victim = next((k for k in self.resident if k not in used), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras={self.max_loras} adapters")
            slot = self.resident.pop(victim)
        self._load(lora, slot)
        self.resident[lora.identity] = slot
        return slot

    def _load(self, lora: LoraRef, slot: int) -> None:
        config = adapter_config(lora.path, self.max_rank)
        for where in self.projections:  # an untargeted projection is zeros
            self.a[where][slot].zero_()
            self.b[where][slot].zero_()
        for where, a, b in read_weights(lora.path, config, self.projections, self.max_rank):
            self.a[where][slot].copy_(a)
            self.b[where][slot].copy_(b)
        self.num_loads += 1
        logger.info("LoRA adapter %s in slot %d (rank %d)", lora.identity, slot, config.rank)
