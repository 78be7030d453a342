"""Pure-decode forward passes captured as CUDA graphs, one per padded batch size.

NOTE: why whole-forward graphs. A decode step of a 1B model is ~16 layers x ~9 kernels of a few
microseconds each; launched one by one from Python the host is the bottleneck (measured: 29.5 ms
for a step the GPU does in ~1 ms). vLLM captures "piecewise" graphs (everything but attention,
which runs eagerly between the pieces) so one graph serves prefill, decode and mixed batches of a
given token count; that pays off when attention cannot be captured (variable-length prefill
kernels) and under torch.compile. Here the paged decode kernel is capture-safe as it is (its grid
depends only on the batch size and the fixed block-table width, never on seq lens), so the whole
decode forward — embedding to final norm — is one graph per batch size: one launch per step
instead of ~150. Prefill and mixed steps run eagerly; they are GPU-bound (thousands of tokens per
launch), where graphs gain nothing.

Capture: batch sizes 1, 2, 4, 8, then every 8 up to ``max_num_seqs`` (at most 512), largest first
into one shared memory pool (smaller graphs reuse the larger one's activations). Every graph
reads the runner's persistent input buffers at fixed addresses (``InputBuffers.views``) with a
fixed block-table width: ``max_model_len``'s blocks unless ``max_seq_len_to_capture`` asks for
less. The width costs the host nothing (the step's table is gathered on the device from the
block-table rows, ``common/block_table.py``) and the decode kernel's grid does not follow it
(``kernels/paged_decode_attention.py``: each row cuts its own partitions), so every context
stays in the graph. A step is padded to the next captured size with rows of seq len 0 (output
zeros, never sampled). A step verifying speculative drafts replays the same graphs: each of a
sequence's ``k + 1`` tokens is its own attention row whose seq len ends at its position
(``StepInputs``' per-token rows), so a batch of ``B`` verifications is a decode step of
``B (k + 1)`` rows; each row reads the shared context again (``k + 1`` reads of it instead of
one), the price of one launch instead of ~10 per layer from Python. Steps with more rows than
the largest graph, a prefill chunk, or connector work inside the layers (layer-wise KV
load/save) run eagerly. ``--enforce-eager`` turns graphs off.

On a CPU the same class runs the padded, fixed-address forward eagerly (``capture=False``): tests
use it to check that a padded graph-shaped step gives the tokens of an eager step.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from common.step_inputs import InputBuffers, StepInputs
from common.step_outputs import ScheduledRequest

if TYPE_CHECKING:
    from common.config import RunnerConfig
    from common.lora.batch import GraphLoraBatch
    from common.lora.manager import LoraManager
    from common.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_MAX_CAPTURE = 512


def capture_sizes(max_num_seqs: int, asked: tuple[int, ...] | None = None) -> list[int]:
    """Batch sizes to capture: ``asked``, else 1, 2, 4, 8, 16, 24, … up to max_num_seqs."""
    if asked:
        return sorted({s for s in asked if 0 < s <= max_num_seqs})
    top = min(max_num_seqs, _MAX_CAPTURE)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return sizes


class DecodeGraphs:
    """Captured decode steps of one model over its runner's input buffers (``inputs``: the
    persistent buffers every graph reads at fixed addresses). ``capture=False``: same shapes,
    run eagerly."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        inputs: InputBuffers,
        block_size: int,
        sizes: list[int],
        max_seq_len: int,
        capture: bool,
        lora: LoraManager | None = None,
    ) -> None:
        """``lora``: the runner's adapter slots (LoRA on): graphs apply each row's adapter."""
        self.model, self.inputs, self.block_size = model, inputs, block_size
        self.lora = lora
        self._lora_rows: GraphLoraBatch | None = None  # captured: fixed buffers, refilled
        self.sizes = sorted(sizes)
        self.row_stride = -(-max_seq_len // block_size)  # block-table width of a graph
        self.capture = capture
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._kv_layers: list[torch.Tensor] | None = None
        self.replays = 0  # steps run through a graph (on CPU: graph-shaped)

    @staticmethod
    def for_config(
        model: LlamaForCausalLM,
        inputs: InputBuffers,
        config: RunnerConfig,
        block_size: int,
        max_model_len: int,
        capture: bool,
        lora: LoraManager | None = None,
    ) -> DecodeGraphs:
        """The sizes and context a runner's config asks for (``max_seq_len_to_capture``, else
        ``max_model_len``; ``max_num_seqs``, ``cuda_graph_sizes``)."""
        asked = config.max_seq_len_to_capture
        max_seq_len = max_model_len if asked is None else min(asked, max_model_len)
        sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
        return DecodeGraphs(model, inputs, block_size, sizes, max_seq_len, capture, lora)

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def size_for(self, scheduled: list[ScheduledRequest]) -> int | None:
        """The captured size a step pads to, or None when it must run eagerly."""
        if not scheduled or len(scheduled) > self.max_size or self._kv_layers is None:
            return None
        limit = self.row_stride * self.block_size
        n = 0  # attention rows: one per token
        for s in scheduled:
            q = s.num_new_tokens
            if q != 1 + len(s.spec_token_ids) or s.num_computed_tokens + q > limit:
                return None  # a prompt chunk, or a context past the tables
            n += q
        return next((size for size in self.sizes if size >= n), None)

    # -- capture and replay ---------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self, kv_layers: list[torch.Tensor]) -> None:
        """Capture every size (largest first, one memory pool). On CPU: only remember the cache."""
        self._kv_layers = kv_layers
        if not self.capture:
            return
        device = kv_layers[0].device
        if self.lora is not None:
            self._lora_rows = self.lora.graph_batch(self.max_size)
        start = time.perf_counter()
        before = torch.cuda.memory_reserved(device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._capture(size, pool)
        torch.cuda.synchronize(device)
        used = torch.cuda.memory_reserved(device) - before
        logger.info(
            "captured %d decode graphs (batch 1..%d, context <= %d) in %.1f s, %.0f MiB",
            len(self.sizes),
            self.max_size,
            self.row_stride * self.block_size,
            time.perf_counter() - start,
            used / 2**20,
        )

    def _capture(self, size: int, pool) -> None:
        self.inputs.fill_padding(size, self.row_stride)
        for _ in range(2):  # compiles the kernels and settles the allocator outside the capture
            self._forward(size)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self._outputs[size] = self._forward(size)
        self._graphs[size] = graph

    def _forward(self, size: int) -> torch.Tensor:
        v = self.inputs.views(size, size, self.row_stride)
        assert self._kv_layers is not None
        v.meta.lora = self._lora_rows  # every tile a padding one until a replay refills them
        return self.model(v.input_ids, v.positions, self._kv_layers, v.meta)

    def replay(
        self, size: int, inputs: StepInputs, lora_slots: np.ndarray | None = None
    ) -> torch.Tensor:
        """Hidden states ``(size, hidden)`` of the step just written into the input buffers
        (``inputs``: their views, padded to ``size``; a graph reads the same addresses).
        ``lora_slots``: each real row's adapter slot (None: none has one)."""
        self.replays += 1
        if not self.capture:
            assert self._kv_layers is not None
            use = self.lora is not None and lora_slots is not None
            rows = self.lora.batch(lora_slots) if use else None  # type: ignore[union-attr, arg-type]
            inputs.meta.lora = rows
            return self.model(inputs.input_ids, inputs.positions, self._kv_layers, inputs.meta)
        if self._lora_rows is not None:
            self._lora_rows.refill([] if lora_slots is None else lora_slots)
        self._graphs[size].replay()
        return self._outputs[size]
