"""Every Triton variant the engine can launch, compiled at start-up: none compiles mid-serving.

NOTE: what makes a variant. Triton compiles one binary per specialisation of a kernel: the values
of its constexprs, each tensor's dtype, whether each pointer is 16-byte aligned, and for each int
argument its width (i32/i64) and whether it is 1 or a multiple of 16. A variant first met inside
the engine loop compiles there, for a second or more, while every request in flight waits. So
the launchers keep the set finite and known from the model's shape and the batch limits alone:

- constexprs are the model's shape (heads, head_dim, hidden, intermediate, block size, dtype) or
  buckets of the step's shape: prefill ``BLOCK_M`` in {16, 32, 64, 128} by the longest query
  times the GQA group; decode
  tiles of 16 keys (a batch too small to fill the GPU with 64-key partitions) or 64;
- ints that change from step to step (the block tables' row stride, the decode plan's split
  count and shortest partition) are ``do_not_specialize``, and the metadata pointers (views into the step's input buffers, at
  offsets that need not be aligned) are not specialised on alignment;
- strides of activations and of the KV cache are fixed by the model and the cache and stay
  specialised (divisibility lets loads vectorise): :func:`warm_up` launches over the engine's
  own cache, so a stride past 2**31 (an i64) is met here too.

```
kernel                          variants of one engine (shape and dtype fixed)
rms_norm                        hidden, without and with the residual; head_dim (q/k norm)
rotary_embedding_and_cache      1
silu_and_mul                    1
paged_prefill_attention         BLOCK_M 16, 32, 64, 128 (those max_num_batched_tokens reaches)
paged_decode_attention          BLOCK_N 16, 64
paged_decode_reduce             BLOCK_N 16, 64
gather_blocks, scatter_blocks   1 each (the KV connector's save and load)
sample_tiles, sample_pick       1 each (the sampler, per vocabulary: ModelShape.vocab_size)
lora (shrink, expand)           1 each (EXPAND False, True; per padded rank: ModelShape.lora_rank)
```

Llama-3-8B: 16 variants (2 of them the sampler's; 2 more with LoRA), about 1 s each to compile
cold on one core;
Triton's cache directory (``common/cache_dir.py``) keeps them for the next start.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from kernels._common import check
from kernels.activation import silu_and_mul
from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.lora import lora_expand, lora_shrink
from kernels.paged_decode_attention import paged_decode_attention, warmup_plans
from kernels.paged_prefill_attention import paged_prefill_attention, prefill_plan
from kernels.rms_norm import fused_add_rms_norm, rms_norm
from kernels.rotary import rotary_embedding_and_cache
from kernels.sampler import warm_up_sampler

logger = logging.getLogger(__name__)

_EPS = 1e-6  # a float argument: not part of any variant


@dataclass(frozen=True)
class ModelShape:
    """What one rank's decoder layers hand the kernels (under tensor parallelism: its share)."""

    num_heads: int  # query heads
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    qk_norm: bool = False  # Qwen3: rms_norm over each q and k head before RoPE
    vocab_size: int = 0  # > 0: the sampler's kernels are warmed too
    lora_rank: int = 0  # > 0: the adapter slots' padded rank; the LoRA kernels are warmed too

    def __post_init__(self) -> None:
        sizes = (self.num_heads, self.num_kv_heads, self.head_dim, self.hidden_size)
        check(min(*sizes, self.intermediate_size) > 0, f"sizes must be positive: {self}")
        check(self.num_heads % self.num_kv_heads == 0, f"q heads not a multiple of kv: {self}")


class LaunchLimits(Protocol):
    """The largest step the engine runs (``common.step_inputs.BatchLimits`` is one)."""

    @property
    def max_tokens(self) -> int: ...  # tokens per step


class WarmupReport(NamedTuple):
    launcher_calls: int
    seconds: float


def warm_up(shape: ModelShape, limits: LaunchLimits, kv_cache: torch.Tensor) -> WarmupReport:
    """Launch (so compile) every kernel variant an engine of ``shape`` can launch.

    ``kv_cache``: the engine's whole cache ``(L, 2, N, bs, Hkv, D)``, in the model's dtype on its
    device. It is left as it was: the inputs are padding (sequences of length 0, slot -1) and the
    block copies put block 0 back where they read it. On CUDA the kernels run (on the current
    stream, synchronised before returning); under ``kernels.cross_compile.compile_only`` they
    only compile.
    """
    check(
        kv_cache.dim() == 6 and kv_cache.shape[4:] == (shape.num_kv_heads, shape.head_dim),
        f"kv_cache {tuple(kv_cache.shape)} is not (L, 2, N, bs, {shape.num_kv_heads}, "
        f"{shape.head_dim})",
    )
    start = time.perf_counter()
    layer = kv_cache[0]  # (2, N, bs, Hkv, D), as every layer's view
    calls = _layer_ops(shape, layer)
    calls += _prefill(shape, layer, limits.max_tokens)
    calls += _decode(shape, layer)
    calls += _block_copies(kv_cache)
    if shape.vocab_size > 0:
        calls += warm_up_sampler(shape.vocab_size, kv_cache.device)
    if shape.lora_rank > 0:
        calls += _lora(shape, layer)
    if kv_cache.device.type == "cuda":
        torch.cuda.synchronize(kv_cache.device)
    report = WarmupReport(calls, time.perf_counter() - start)
    logger.info("Triton kernels warmed: %d launches in %.1f s", *report)
    return report


def prefill_query_lens(max_tokens: int, queries_per_kv: int) -> list[int]:
    """One longest-query length per prefill ``BLOCK_M`` a step of ``max_tokens`` can reach (the
    decode kernel serves every one-token query)."""
    first: dict[int, int] = {}
    for n in range(2, max_tokens + 1):
        first.setdefault(prefill_plan(n, queries_per_kv).block_m, n)
    return list(first.values())


def _layer_ops(shape: ModelShape, layer: torch.Tensor) -> int:
    """The fused ops of a decoder layer, with the operands the model hands them."""
    s = shape
    zeros = layer.new_zeros
    x = zeros(1, s.hidden_size)
    norm_weight = layer.new_ones(s.hidden_size)
    h = rms_norm(x, norm_weight, _EPS)  # the first layer's input norm
    fused_add_rms_norm(h, x, norm_weight, _EPS)  # every other norm
    qkv = zeros(1, (s.num_heads + 2 * s.num_kv_heads) * s.head_dim)
    calls = 2  # the two norms
    if s.qk_norm:  # heads as rows, as the model's _norm_heads
        rms_norm(
            qkv[:, : s.num_heads * s.head_dim].reshape(-1, s.head_dim), zeros(s.head_dim), _EPS
        )
        calls += 1
    positions = torch.zeros(1, dtype=torch.int64, device=layer.device)
    slots = torch.full((1,), -1, dtype=torch.int64, device=layer.device)  # writes nothing
    cos_sin = zeros(1, s.head_dim)
    rotary_embedding_and_cache(qkv, positions, cos_sin, layer, slots, s.num_heads, s.num_kv_heads)
    silu_and_mul(zeros(1, 2 * s.intermediate_size))
    return calls + 2


def _metadata(num_seqs: int, width: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(block_tables, query_start_loc, seq_lens) of ``num_seqs`` empty sequences."""
    i32 = {"dtype": torch.int32, "device": device}
    return (
        torch.zeros(num_seqs, width, **i32),
        torch.zeros(num_seqs + 1, **i32),
        torch.zeros(num_seqs, **i32),
    )


def _prefill(shape: ModelShape, layer: torch.Tensor, max_tokens: int) -> int:
    lens = prefill_query_lens(max_tokens, shape.num_heads // shape.num_kv_heads)
    # One tile of an empty sequence: the kernel runs and reads and writes nothing.
    tiles = torch.zeros(1, 2, dtype=torch.int32, device=layer.device)
    for max_query_len in lens:
        q = layer.new_zeros(max_query_len, shape.num_heads, shape.head_dim)
        tables, query_start_loc, seq_lens = _metadata(1, 1, layer.device)
        scale = shape.head_dim**-0.5
        args = (q, layer, tables, query_start_loc, seq_lens, max_query_len, scale)
        paged_prefill_attention(*args, tiles=tiles)
    return len(lens)


def _decode(shape: ModelShape, layer: torch.Tensor) -> int:
    """Each variant of both passes: by tile size only (the plan's ints are not specialised)."""
    plans = warmup_plans()
    for plan in plans:
        q = layer.new_zeros(1, shape.num_heads, shape.head_dim)
        tables, _, seq_lens = _metadata(1, 1, layer.device)
        paged_decode_attention(q, layer, tables, seq_lens, shape.head_dim**-0.5, plan=plan)
    return len(plans)


def _block_copies(kv_cache: torch.Tensor) -> int:
    """The KV connector's copies: one layer's blocks per call, as it saves and loads them."""
    layer = kv_cache[0].unsqueeze(0)  # (1, 2, N, bs, Hkv, D)
    block_ids = torch.zeros(1, dtype=torch.int64, device=kv_cache.device)
    packed = gather_blocks(layer, block_ids)
    scatter_blocks(layer, block_ids, packed)  # block 0 back as it was
    return 2


def _lora(shape: ModelShape, layer: torch.Tensor) -> int:
    """Each projection's shrink and its expands into the projection's output columns (q|k|v,
    o, gate|up, down), over one padding tile: the kernels run and write nothing. The number of
    adapter slots is no part of a variant: one slot's weights stand for them."""
    s, rank = shape, shape.lora_rank
    zeros = layer.new_zeros
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    sorted_tokens = torch.zeros(1, dtype=torch.int32, device=layer.device)
    tiles = torch.tensor([[0, 0, -1]], dtype=torch.int32, device=layer.device)
    projections = (  # (input width, the output's column slices)
        (s.hidden_size, (q, kv, kv)),
        (q, (s.hidden_size,)),
        (s.hidden_size, (s.intermediate_size, s.intermediate_size)),
        (s.intermediate_size, (s.hidden_size,)),
    )
    calls = 0
    for width, slices in projections:
        shrunk = zeros(1, rank)
        lora_shrink(zeros(1, width), zeros(1, rank, width), sorted_tokens, tiles, shrunk)
        for y in zeros(1, sum(slices)).split(slices, dim=1):  # column slices, as the model's
            lora_expand(shrunk, zeros(1, y.shape[1], rank), sorted_tokens, tiles, y)
        calls += 1 + len(slices)
    return calls
