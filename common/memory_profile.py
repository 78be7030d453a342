"""How much GPU memory the KV cache may take (CUDA only).

The budget is ``gpu_memory_utilization`` of the device (and never more than is free now), minus
what this process already holds (the weights), minus the peak of the largest step the engine can
run (a full ``max_num_batched_tokens`` prefill, and a ``max_num_seqs`` decode with every row
sampled through top-p, the sampler's worst case), minus the decode graphs' private pool (measured
as the activations of the largest captured decode batch, which the pool keeps), minus what the
sampler keeps between steps (the penalty counts of ``max_num_seqs`` rows, made only when a
penalised request comes, so no profiled step shows them), minus a margin.
Both peaks are measured by running those steps once on a scratch cache before the real one
exists, so nothing is guessed from the model's shape.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from common.kv_interface import KVCacheSpec
from common.request import Request
from common.sampling_params import SamplingParams
from common.step_outputs import ScheduledRequest

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


@dataclass(frozen=True)
class StepLimits:
    """The largest steps an engine can run: what the budget leaves room for."""

    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    graph_batch: int | None  # the largest captured decode batch; None: no decode graphs
    sampler_state_bytes: int = 0  # kept between steps: the penalty counts at their largest


class ProfileStep(Protocol):
    """How the runner runs one step for the profile (``ModelRunner._profile_step``)."""

    def __call__(
        self, scheduled: list[ScheduledRequest], kv_layers: list[torch.Tensor], sample: bool
    ) -> None:
        """The step of ``scheduled`` over a scratch cache (``kv_layers``: its per-layer views);
        ``sample``: through the LM head and the sampler too."""


def cuda_kv_budget(
    device: torch.device,
    spec: KVCacheSpec,
    limits: StepLimits,
    run_step: ProfileStep,
    utilization: float,
) -> int:
    """Bytes the KV cache may use on ``device``. Raises ValueError when none are left."""
    torch.cuda.synchronize(device)
    # blocks freed while loading stay in the allocator's cache, and reserved memory counts
    # them: release them first, so what counts as held is what the weights really hold
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    held = torch.cuda.memory_reserved(device)  # the weights, mostly
    tokens, max_len = limits.max_num_batched_tokens, limits.max_model_len
    lens = [min(tokens, max_len)] * max(1, tokens // max_len)
    prefill = _profile(device, spec, run_step, lens, lens)
    decode_rows = limits.max_num_seqs
    decode = _profile(device, spec, run_step, [1] * decode_rows, [1] * decode_rows)
    graphs = 0
    if limits.graph_batch is not None:
        n = limits.graph_batch
        graphs = _profile(device, spec, run_step, [1] * n, [1] * n, sample=False)
    step, kept = max(prefill, decode), limits.sampler_state_bytes
    budget = int(min(total * utilization - held, free) - step - graphs - kept - _MARGIN)
    logger.info(
        "GPU memory: %.1f GiB total, %.1f GiB held (weights), step peak %.2f GiB, decode graphs"
        " %.2f GiB, sampler state %.2f GiB -> %.1f GiB for the KV cache",
        total / 2**30,
        held / 2**30,
        step / 2**30,
        graphs / 2**30,
        kept / 2**30,
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
    device: torch.device,
    spec: KVCacheSpec,
    run_step: ProfileStep,
    seq_lens: list[int],
    query_lens: list[int],
    sample: bool = True,
) -> int:
    """Peak bytes allocated by one step of these sequences, beyond its scratch KV cache."""
    bs = spec.block_size
    blocks = [-(-n // bs) for n in seq_lens]
    shape = (spec.num_layers, 2, sum(blocks), bs, spec.num_kv_heads, spec.head_dim)
    cache = torch.zeros(shape, dtype=spec.dtype, device=device)
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
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run_step(scheduled, list(cache.unbind(0)), sample)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del cache
    torch.cuda.empty_cache()
    return peak
