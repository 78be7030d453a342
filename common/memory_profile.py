"""How much GPU memory the KV cache may take (CUDA only).

The budget is ``gpu_memory_utilization`` of the device (and never more than is free now), minus
what this process already holds (the weights), minus the peak of the largest step the engine can
run (a full ``max_num_batched_tokens`` prefill, and a ``max_num_seqs`` decode with every row
sampled through top-p, the sampler's worst case), minus the decode graphs' private pool (measured
as the activations of the largest captured decode batch, which the pool keeps), minus a margin.
Both peaks are measured by running those steps once on a scratch cache before the real one
exists, so nothing is guessed from the model's shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.request import Request
from common.sampling_params import SamplingParams
from common.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from common.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_MARGIN = 512 * 2**20  # CUDA context growth, cuBLAS workspaces, fragmentation


@dataclass(frozen=True)
class KVReserve:
    """What a second model on the same device takes from the engine's KV budget (a draft
    model, as vLLM reserves for its drafter): its weights, not yet loaded when the target sizes
    its cache, and its KV bytes for every block of the target's (the draft's cache has the
    same block count, so the two are sized together)."""

    weight_bytes: int
    bytes_per_block: int


def cuda_kv_budget(runner: ModelRunner, utilization: float) -> int:
    """Bytes the KV cache may use on ``runner.device``. Raises ValueError when none are left."""
    dev = runner.device
    torch.cuda.synchronize(dev)
    # blocks freed while loading stay in the allocator's cache, and reserved memory counts
    # them: release them first, so what counts as held is what the weights really hold
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    held = torch.cuda.memory_reserved(dev)  # the weights, mostly
    cfg = runner.config
    tokens = cfg.max_num_batched_tokens
    lens = [min(tokens, runner.max_model_len)] * max(1, tokens // runner.max_model_len)
    prefill = _profile(runner, lens, lens)
    decode_rows = cfg.max_num_seqs
    decode = _profile(runner, [1] * decode_rows, [1] * decode_rows)
    graphs = 0
    if runner.graphs is not None:
        n = runner.graphs.max_size
        graphs = _profile(runner, [1] * n, [1] * n, sample=False)
    step = max(prefill, decode)
    budget = int(min(total * utilization - held, free) - step - graphs - _MARGIN)
    logger.info(
        "GPU memory: %.1f GiB total, %.1f GiB held (weights), step peak %.2f GiB, decode graphs"
        " %.2f GiB -> %.1f GiB for the KV cache",
        total / 2**30,
        held / 2**30,
        step / 2**30,
        graphs / 2**30,
        budget / 2**30,
    )
    if budget <= 0:
        raise ValueError(
            "no GPU memory left for the KV cache: raise gpu_memory_utilization, or lower"
            " max_num_batched_tokens / max_num_seqs (or set kv_cache_memory_gb)"
        )
    return budget


@torch.inference_mode()
def _profile(
    runner: ModelRunner, seq_lens: list[int], query_lens: list[int], sample: bool = True
) -> int:
    """Peak bytes allocated by one step of these sequences, beyond its scratch KV cache."""
    dev, bs, spec = runner.device, runner.block_size, runner.spec
    blocks = [-(-n // bs) for n in seq_lens]
    shape = (spec.num_layers, 2, sum(blocks), bs, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(shape, dtype=spec.dtype, device=dev)
    scheduled, first = [], 0
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
    for i, (n, q) in enumerate(zip(seq_lens, query_lens)):
        request = Request(
            f"profile-{i}", [0] * n, params, eos_token_id=None, block_size=bs, seed=i, max_tokens=1
        )
        request.num_output_placeholders = 1
        ids = list(range(first, first + blocks[i]))
        first += blocks[i]
        scheduled.append(ScheduledRequest(request, q, True, ids, n - q))
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    inputs = runner.inputs.prepare(scheduled, {})
    hidden = runner.model(inputs.input_ids, inputs.positions, list(cache.unbind(0)), inputs.meta)
    if sample and runner.tp is not None and runner.tp.rank > 0:  # its share of the gather
        runner.model.lm_head(hidden.index_select(0, inputs.logits_rows))
    elif sample:
        logits = runner.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        rows = runner._sample_rows(scheduled)[0]
        runner.sampler.sample(logits, rows)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del cache, hidden, inputs
    torch.cuda.empty_cache()
    return peak
