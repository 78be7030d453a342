"""A varied workload through the engine's launch sites, for the count of Triton compilations
after warm-up (run by ``cross_compile_child`` under ``compile_only``: kernels compile, never run).

The launch sites are the engine's own code: the model's forward (one decoder layer of a real
shape, its fused ops routed to the Triton launchers as ``torch.ops.pdserve`` routes them on
CUDA), the Triton attention backend, the step input buffers (``InputBuffers.prepare``: eager
steps with their widest block table, decode steps padded to a graph's size and width), and the
KV connector's block copies. Outputs are never computed, so the values flowing through are
meaningless; the shapes, strides, dtypes and buffer offsets are the engine's.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import torch
from triton.backends.compiler import GPUTarget

import common.models.llama as llama
from common.attention import TritonAttentionBackend
from common.models.llama import LlamaArgs, LlamaForCausalLM
from common.models.loader import build_on_meta, materialize
from common.models.shapes import SHAPES
from common.request import Request
from common.sampling_params import SamplingParams
from common.step_inputs import BatchLimits, InputBuffers
from common.step_outputs import ScheduledRequest
from kernels.activation import silu_and_mul
from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.cross_compile import compile_only
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding_and_cache
from kernels.warmup import ModelShape, warm_up

BLOCK_SIZE = 16
MAX_TOKENS, MAX_SEQS = 512, 16
GRAPH_SIZES = (1, 2, 4, 8, 16)
# the CUDA impls of torch.ops.pdserve (kernels/ops.py), which the model calls on CUDA tensors
TRITON_OPS = SimpleNamespace(
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    silu_and_mul=silu_and_mul,
    rotary_embedding_and_cache=rotary_embedding_and_cache,
)

# (tokens already cached, new tokens, drafts verified): one step's sequences
PREFILLS = [[(0, 5)], [(0, 17)], [(0, 64)], [(0, 512)], [(512, 200)], [(3000, 100)]]
BATCHED = [[(0, 3), (0, 9), (100, 33)], [(0, 30), (40, 1), (1000, 1)], [(100, 4, 3), (7, 1)]]
CONTEXTS = [1, 2, 16, 17, 33, 300, 513, 1024, 1500, 2049, 3333, 4095]


def _decodes(batch: int, shift: int) -> list[tuple[int, ...]]:
    lens = itertools.islice(itertools.cycle(CONTEXTS), shift, shift + batch)
    return [(n - 1, 1) for n in lens]


def _scheduled(step: list[tuple[int, ...]]) -> list[ScheduledRequest]:
    out = []
    for i, (cached, new, *drafts) in enumerate(step):
        num_drafts = drafts[0] if drafts else 0
        prompt = [1] * (cached + new - num_drafts)
        request = Request(
            str(i), prompt, SamplingParams(), eos_token_id=None, block_size=BLOCK_SIZE, seed=0,
            max_tokens=8,
        )  # fmt: skip
        blocks = list(range(-(-(cached + new) // BLOCK_SIZE)))
        out.append(ScheduledRequest(request, new, True, blocks, cached, [2] * num_drafts))
    return out


def _model(case: dict[str, Any], dtype: torch.dtype) -> LlamaForCausalLM:
    """One decoder layer of a real shape, weights zero (they never meet a kernel's values)."""
    args = LlamaArgs.from_hf({**SHAPES[case["shape"]], "num_hidden_layers": 1, "vocab_size": 256})
    model = build_on_meta(args, TritonAttentionBackend(), case["max_model_len"], None)
    materialize(model, dtype, torch.device("cpu"))
    for param in model.parameters():
        param.data.zero_()
    return model


def _drive(model: LlamaForCausalLM, inputs: InputBuffers, kv_cache: torch.Tensor) -> int:
    """Every step of the workload through the model; returns the number of steps."""
    kv_layers = list(kv_cache.unbind(0))
    graph_stride = inputs.limits.max_blocks_per_seq
    steps = 0
    for step, graph in _steps():
        scheduled = _scheduled(step)
        padded = next(s for s in GRAPH_SIZES if s >= len(step)) if graph else None
        stride = graph_stride if graph else None
        batch = inputs.prepare(scheduled, {}, padded_seqs=padded, row_stride=stride)
        model(batch.input_ids, batch.positions, kv_layers, batch.meta)
        steps += 1
    return steps


def _steps() -> list[tuple[list[tuple[int, ...]], bool]]:
    """(step, graph-shaped): prefills, mixed batches, eager and graph-shaped decodes."""
    eager = [_decodes(batch, shift) for shift, batch in enumerate((1, 2, 3, 5, 7, 16))]
    graph = [_decodes(batch, shift) for shift, batch in enumerate((1, 2, 3, 8, 13, 16))]
    return [(s, False) for s in PREFILLS + BATCHED + eager] + [(s, True) for s in graph]


def _block_copies(kv_cache: torch.Tensor) -> None:
    """The connector's copies: a layer's blocks of a step's saves, then loads of fetched ones."""
    layer = kv_cache[0].unsqueeze(0)
    for n in (1, 5, 40):
        ids = torch.arange(n + 1, dtype=torch.int64)[1:]  # a view at an offset, too
        scatter_blocks(layer, ids, gather_blocks(layer, ids))


def run_workload(case: dict[str, Any]) -> dict[str, Any]:
    """Warm up, then the workload; the variants it compiled after warm-up (expected: none)."""
    torch.set_flush_denormal(True)
    dtype = getattr(torch, case["dtype"])
    model = _model(case, dtype)
    a = model.args
    shape = ModelShape(
        a.num_heads, a.num_kv_heads, a.head_dim, a.hidden_size, a.intermediate_size, a.qk_norm
    )
    blocks_per_seq = -(-case["max_model_len"] // BLOCK_SIZE)
    inputs = InputBuffers(
        BatchLimits(MAX_TOKENS, MAX_SEQS, blocks_per_seq), BLOCK_SIZE, torch.device("cpu")
    )
    kv_cache = torch.zeros(
        (1, 2, blocks_per_seq + 1, BLOCK_SIZE, a.num_kv_heads, a.head_dim), dtype=dtype
    )
    real_ops, llama._ops = llama._ops, TRITON_OPS
    try:
        with compile_only(GPUTarget("cuda", case["arch"], 32)) as log, torch.inference_mode():
            warm_up(shape, inputs.limits, kv_cache)
            warmed, launches = len(log.compiled), log.launches
            steps = _drive(model, inputs, kv_cache)
            _block_copies(kv_cache)
            after = log.compiled[warmed:]
    finally:
        llama._ops = real_ops
    new = [{"kernel": v.kernel, "constants": str(v.constants)} for v in after]
    return {"warmed": warmed, "steps": steps, "launches": log.launches - launches, "new": new}
