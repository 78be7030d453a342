"""The model runner: the only component that builds tensors.

Per step it writes the scheduler's plan into persistent input buffers (``common/step_inputs.py``),
runs the model once over every scheduled token of every request (prefill chunks and decodes
mixed) — or replays a captured CUDA graph for a pure-decode step (``common/cuda_graphs.py``) —
computes logits only for rows that need a next token and samples them in one batched call.

Nothing between the input copy and the sampled ids waits for the device: the step's one sync is
``StepResult.tokens()``, which the engine calls after it has already launched the next step when
it schedules ahead.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import torch

from common import penalty_counts
from common.attention import LayerHooks, get_attention_backend
from common.config import CacheConfig, RunnerConfig
from common.cuda_graphs import DecodeGraphs
from common.host_kv_tier import HostCopies, HostKVTier
from common.host_memory import keep_freed_host_memory, zeros_on_huge_pages
from common.kv_connector import ConnectorHooks, KVConnectorWorker
from common.kv_interface import ConnectorMetadata, KVCacheSpec
from common.lora.manager import LoraManager
from common.memory_profile import KVReserve, StepLimits, cuda_kv_budget
from common.models.llama import LlamaForCausalLM
from common.models.loader import build_model, kv_cache_torch_dtype, resolve_dtype
from common.parallel.group import TensorParallel, agree_on_min
from common.prompt_logprobs import PromptLogprobsChunk, compute_prompt_logprobs
from common.request import TokenLogprobs
from common.sampler import Sampler, SamplerOutput, SampleRow
from common.step_inputs import BatchLimits, InputBuffers, StepInputs
from common.step_outputs import SampledToken, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_GB = 0.5


def resolve_device(name: str) -> torch.device:
    """``auto``: CUDA when there is one, else the CPU. A CUDA device always has its index
    (``cuda`` is the current device), so kernels, streams and events can be bound to it."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def bind_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (a no-op on the CPU, or when it is
    already). Triton launches, ``torch.cuda.Event()`` and the current stream follow the current
    device, not a tensor's: an engine on ``cuda:1`` that did not bind it would launch its
    kernels and record its step events on device 0."""
    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)


class StepResult:
    """The sampled tokens of one step. On CUDA their copy to pinned host memory starts at once;
    ``tokens()`` is the step's single wait for the device.

    ``owners[i]`` owns ``counts[i]`` consecutive rows: 1, or ``k + 1`` for a request verifying
    ``k`` speculative drafts (``verified_tokens()``). ``prompt_logprobs``: the prompt tokens
    this step scored, per request asking for them (already on the host); ``sampled`` is None
    for a step that sampled nothing but scored prompt tokens."""

    def __init__(
        self,
        sampled: SamplerOutput | None,
        rows: list[SampleRow],
        owners: list[str],
        counts: list[int] | None = None,
        prompt_logprobs: dict[str, PromptLogprobsChunk] | None = None,
    ):
        self.rows, self.owners = rows, owners
        self.counts = counts or [1] * len(owners)
        self.prompt_logprobs = prompt_logprobs or {}
        self._per_row: list[SampledToken] | None = None
        self._event: torch.cuda.Event | None = None
        if sampled is None:
            self._per_row = []
            return
        tensors = [t for t in sampled if t is not None]
        if tensors and tensors[0].device.type == "cuda":
            tensors = [_to_pinned(t) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(sampled.token_ids.device))
        it = iter(tensors)
        self._host = SamplerOutput._make(next(it) if t is not None else None for t in sampled)

    def tokens(self) -> dict[str, SampledToken]:
        """The token of every request sampling one row."""
        per_row, row = self._rows(), 0
        if len(per_row) == len(self.owners):  # no drafts: one row each, in order
            return dict(zip(self.owners, per_row))
        out: dict[str, SampledToken] = {}
        for owner, count in zip(self.owners, self.counts):
            if count == 1:
                out[owner] = per_row[row]
            row += count
        return out

    def verified_tokens(self) -> dict[str, list[SampledToken]]:
        """The target's samples at every verified position of the requests with drafts."""
        per_row, row = self._rows(), 0
        if len(per_row) == len(self.owners):  # no drafts
            return {}
        out: dict[str, list[SampledToken]] = {}
        for owner, count in zip(self.owners, self.counts):
            if count > 1:
                out[owner] = per_row[row : row + count]
            row += count
        return out

    def _rows(self) -> list[SampledToken]:
        if self._per_row is None:
            if self._event is not None:
                self._event.synchronize()
            result = self._host
            token_ids = result.token_ids.tolist()
            lps = _to_token_logprobs(result, token_ids, self.rows)
            if lps is None:
                self._per_row = list(map(SampledToken, token_ids))
            else:
                self._per_row = list(map(SampledToken, token_ids, lps))
        return self._per_row


class ModelRunner:
    """Owns the model, the KV cache tensor, the input buffers, the decode graphs and the sampler
    of one engine."""

    def __init__(
        self,
        model_dir: Path,
        hf_config: dict[str, Any],
        *,
        config: RunnerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        tp: TensorParallel | None = None,
        reserve: KVReserve | None = None,
    ) -> None:
        """``tp``: this runner is one rank of a tensor-parallel group (``common/parallel/``)
        and holds that rank's shard of the weights and KV heads. ``reserve``: a draft model's
        share of this device, taken out of the KV budget before the cache is sized."""
        self.config = config
        self.tp = tp
        self.reserve = reserve
        self.device = resolve_device(config.device)
        bind_device(self.device)
        if self.device.type == "cuda":  # before the first compile (the memory profile's)
            from common.cache_dir import use_triton_cache_dir

            use_triton_cache_dir()
        if self.device.type == "cpu":
            keep_freed_host_memory()  # process-wide; see common/host_memory.py
        self.dtype = resolve_dtype(config.dtype, hf_config)
        self.backend = get_attention_backend(config.attention_backend, self.device)
        self.model: LlamaForCausalLM = build_model(
            model_dir,
            hf_config,
            self.dtype,
            self.device,
            self.backend,
            max_model_len,
            config.load_format,
            config.seed,
            tp,
            config.enable_expert_parallel,
            config.quantization,
        )
        self.lora: LoraManager | None = None
        if config.lora.enable_lora:  # before the cache is sized: the budget sees the slots
            self.lora = LoraManager(
                self.model, config.lora.max_loras, config.lora.max_lora_rank, self.dtype,
                self.device,
            )  # fmt: skip
        a = self.model.args
        kv_heads = self.model.num_local_kv_heads
        self.vocab_size = a.vocab_size
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.kv_dtype = kv_cache_torch_dtype(cache_config.kv_cache_dtype, self.dtype)
        scales = self.model.kv_scales() if self.kv_dtype != self.dtype else ()
        self.spec = KVCacheSpec(
            a.num_layers, kv_heads, a.head_dim, self.block_size, self.kv_dtype, kv_scales=scales
        )
        # what a KV store entry holds: every KV head, whatever the tensor-parallel size
        quantized = config.quantization if not a.fp8 else None  # (an FP8 config says so itself)
        self.store_spec = KVCacheSpec(
            a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.kv_dtype, quantized,
            scales,
        )  # fmt: skip
        blocks_per_seq = -(-max_model_len // self.block_size)
        self.inputs = InputBuffers(
            BatchLimits(
                max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                max_seqs=config.max_num_seqs,
                max_blocks_per_seq=blocks_per_seq,
            ),
            self.block_size,
            self.device,
        )
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:  # TP: every rank, lockstep
            self.graphs = DecodeGraphs.for_config(
                self.model, self.inputs, config, self.block_size, max_model_len, capture=True,
                lora=self.lora,
            )  # fmt: skip
        self.num_blocks = self._num_blocks(cache_config)
        # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): see ARCHITECTURE.md
        shape = (a.num_layers, 2, self.num_blocks, self.block_size, kv_heads, a.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = zeros_on_huge_pages(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_layers = list(self.kv_cache.unbind(0))  # per-layer views, made once
        self.host_tier: HostKVTier | None = None
        if cache_config.kv_offload_gb:
            slots = HostKVTier.num_slots_for(cache_config.kv_offload_gb, self.spec.bytes_per_block)
            if slots < 1:
                raise ValueError(
                    f"kv_offload_gb={cache_config.kv_offload_gb:g} holds no KV block "
                    f"({self.spec.bytes_per_block} bytes)"
                )
            self.host_tier = HostKVTier(slots, self.kv_cache)
        if self.device.type == "cuda":
            self._warm_up_kernels()
        if self.graphs is not None:
            self.graphs.capture_all(self.kv_layers)
        self.connector: KVConnectorWorker | None = None
        self.hooks: LayerHooks | None = None
        # the last step's sampled ids (device) and each request's row in them: a token still
        # in flight is read from here by the next step (see common/step_inputs.py)
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}

    def close(self) -> None:
        """Nothing to release on one device (``ParallelModelRunner`` stops its workers)."""

    def _warm_up_kernels(self) -> None:
        """Compile every Triton variant this runner can launch now, not in the steps that first
        meet them (``kernels/warmup.py``), into the persistent Triton cache (a restart loads
        them): this rank's heads and MLP share, the step limits, the real cache."""
        from kernels.warmup import ModelShape, warm_up

        a, share = self.model.args, self.tp.size if self.tp is not None else 1
        heads, kv_heads = a.num_heads // share, self.model.num_local_kv_heads
        inter = a.intermediate_size // share
        lora = self.config.lora
        shape = ModelShape(
            heads, kv_heads, a.head_dim, a.hidden_size, inter, a.qk_norm, a.vocab_size,
            lora_rank=lora.max_lora_rank if lora.enable_lora else 0,
        )  # fmt: skip
        warm_up(shape, self.inputs.limits, self.kv_cache)

    def set_connector(self, connector: KVConnectorWorker) -> None:
        self.connector = connector
        self.hooks = ConnectorHooks(connector)

    def _num_blocks(self, cfg: CacheConfig) -> int:
        """Blocks the cache gets: ``num_blocks``, or what fits in ``kv_cache_memory_gb``, the
        profiled GPU budget or the CPU default. A draft model's ``reserve`` shares the budget:
        its weights come out of the GPU budget (they load after this), and every block is
        counted with the draft's KV bytes too (its cache gets the same block count)."""
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        reserve = self.reserve or KVReserve(0, 0)
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget(cfg.gpu_memory_utilization) - reserve.weight_bytes
        else:
            budget = _CPU_DEFAULT_KV_GB * 2**30
        num_blocks = max(1, int(budget // (self.spec.bytes_per_block + reserve.bytes_per_block)))
        if self.tp is not None:  # every rank the same count: the smallest
            num_blocks = agree_on_min(self.tp, num_blocks)
        return num_blocks

    def _cuda_kv_budget(self, utilization: float) -> int:
        """The profiled GPU budget: the largest steps this runner can run, run once."""
        c, graphs = self.config, self.graphs
        batch = graphs.max_size if graphs is not None else None
        kept = penalty_counts.reserved_bytes(c.max_num_seqs, self.vocab_size)
        limits = StepLimits(
            c.max_num_batched_tokens, c.max_num_seqs, self.max_model_len, batch, kept
        )
        return cuda_kv_budget(self.device, self.spec, limits, self._profile_step, utilization)

    def _profile_step(
        self, scheduled: list[ScheduledRequest], kv_layers: list[torch.Tensor], sample: bool
    ) -> None:
        """One step over a scratch cache, for the memory profile (``common/memory_profile.py``)."""
        inputs = self.inputs.prepare(scheduled, {})
        hidden = self.model(inputs.input_ids, inputs.positions, kv_layers, inputs.meta)
        if not sample:
            return
        rows = hidden.index_select(0, inputs.logits_rows)
        if self.tp is not None and self.tp.rank > 0:  # its share of the gather
            self.model.lm_head(rows)
        else:
            logits = self.model.compute_logits(rows)
            self.sampler.sample(logits, self._sample_rows(scheduled)[0])

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult | None:
        """Launch one step. Returns its sampled tokens (still on their way) or None.

        With a connector the step runs inside its per-step calls, and its saves are handed
        over once the step's sampling is launched (a tensor-parallel rank 0 collects them then:
        between steps, when every rank is back in its loop); the tokens are returned only once
        the prompts completing now are durable."""
        bind_device(self.device)  # another engine of this process may have bound its own
        connector = self.connector
        if connector is None:
            return self._step(out, hooked=False)
        assert isinstance(out.connector_meta, ConnectorMetadata)
        connector.bind_connector_metadata(out.connector_meta)
        connector.start_load_kv(self.kv_cache)
        try:
            result = self._step(out, hooked=connector.layer_work_pending())
            connector.wait_for_save()
        finally:
            connector.clear_connector_metadata()
        return result

    def _step(self, out: SchedulerOutput, hooked: bool) -> StepResult | None:
        """The model over the step's tokens, then its logits and samples."""
        hidden, inputs = self._run_model(out, hooked)
        prompt = compute_prompt_logprobs(hidden, out.scheduled, self.model.compute_logits)
        if not inputs.num_logits_rows:  # a step of prompt chunks only: nothing sampled
            return StepResult(None, [], [], prompt_logprobs=prompt) if prompt else None
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        rows, owners, counts = self._sample_rows(out.scheduled)
        sampled = self.sampler.sample(logits, rows, out.grammar_bitmask)
        self._remember(sampled.token_ids, owners, counts)
        return StepResult(sampled, rows, owners, counts, prompt)

    def _run_model(self, out: SchedulerOutput, hooked: bool) -> tuple[torch.Tensor, StepInputs]:
        """``hooked``: the connector has per-layer work (no graph replay then)."""
        lora = self.lora.activate(out.scheduled) if self.lora is not None else None
        size = None if hooked or self.graphs is None else self.graphs.size_for(out.scheduled)
        stride = self.graphs.row_stride if size is not None else None  # type: ignore[union-attr]
        inputs = self.inputs.prepare(
            out.scheduled, self._prev_rows, padded_seqs=size, row_stride=stride
        )
        if inputs.num_fill:
            assert self._prev_sampled is not None
            self.inputs.fill_from(inputs, self._prev_sampled)
        self._announce_step(inputs, out, size, hooked)
        if size is not None:
            return self.graphs.replay(size, inputs, lora), inputs  # type: ignore[union-attr]
        inputs.meta.hooks = self.hooks if hooked else None
        inputs.meta.lora = self.lora.batch(lora) if lora is not None else None  # type: ignore[union-attr]
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_layers, inputs.meta)
        return hidden, inputs

    def _announce_step(
        self, inputs: StepInputs, out: SchedulerOutput, graph: int | None, hooked: bool
    ) -> None:
        """Before the forward: a tensor-parallel rank 0 sends the step to the other ranks
        (``common/parallel/executor.py``); one device has no one to tell."""

    def copy_host_tier(self, copies: HostCopies) -> None:
        """Queue a step's copies between the cache and the host tier, before anything else of
        the step (``common/host_kv_tier.py``)."""
        assert self.host_tier is not None
        bind_device(self.device)
        self.host_tier.copy(copies, self.kv_cache)

    def start_loads(self, meta: ConnectorMetadata) -> None:
        """A step with nothing to compute may still have remote loads to start."""
        if self.connector is not None and meta.loads:
            self.connector.bind_connector_metadata(meta)
            self.connector.start_load_kv(self.kv_cache)
            self.connector.clear_connector_metadata()

    def _remember(self, token_ids: torch.Tensor, owners: list[str], counts: list[int]) -> None:
        self._prev_sampled = token_ids
        if counts.count(1) == len(counts):  # no drafts: row i is owner i's
            self._prev_rows = dict(zip(owners, range(len(owners))))
            return
        ends = itertools.accumulate(counts)
        self._prev_rows = {owner: end - 1 for owner, end in zip(owners, ends)}

    def _sample_rows(self, scheduled: list[ScheduledRequest]):
        """One row per request that samples (``k + 1`` rows with ``k`` drafts: position
        ``p + j`` sees the drafts before it as outputs). A row's position counts the outputs
        still in flight before it (its own is the last one)."""
        rows: list[SampleRow] = []
        owners: list[str] = []
        counts: list[int] = []
        for s in scheduled:
            if not s.samples:
                continue
            r = s.request
            position = r.num_output_tokens + r.num_output_placeholders - 1
            drafts = s.spec_token_ids
            owners.append(r.request_id)
            counts.append(len(drafts) + 1)
            for j in range(len(drafts) + 1):
                outputs = r.output_token_ids + drafts[:j] if j else r.output_token_ids
                rows.append(
                    SampleRow(
                        r.sampling_params,
                        r.seed,
                        position + j,
                        r.prompt_token_ids,
                        outputs,
                        r.eos_token_id,
                        r.request_id if j == 0 else None,  # drafts' rows: no kept counts
                    )
                )
        return rows, owners, counts


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy into pinned host memory, started now, not waited for."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _to_token_logprobs(
    result: SamplerOutput, token_ids: list[int], rows: list[SampleRow]
) -> list[TokenLogprobs] | None:
    if result.logprobs is None:
        return None
    chosen = result.logprobs.tolist()
    top_ids = result.top_ids.tolist() if result.top_ids is not None else None
    top_lps = result.top_logprobs.tolist() if result.top_logprobs is not None else None
    out = []
    for i, row in enumerate(rows):
        k = row.params.logprobs or 0
        ids = top_ids[i][:k] if top_ids is not None else []
        lps = top_lps[i][:k] if top_lps is not None else []
        out.append(TokenLogprobs(token_ids[i], chosen[i], ids, lps))
    return out
