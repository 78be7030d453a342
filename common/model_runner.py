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

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.attention import LayerHooks, get_attention_backend
from common.config import CacheConfig, RunnerConfig
from common.cuda_graphs import DecodeGraphs
from common.host_memory import keep_freed_host_memory, zeros_on_huge_pages
from common.kv_connector import ConnectorHooks, ConnectorMetadata, KVConnectorWorker
from common.models.llama import LlamaForCausalLM
from common.models.loader import build_model, resolve_dtype
from common.request import TokenLogprobs
from common.sampler import Sampler, SamplerOutput, SampleRow, to_device
from common.scheduler import SampledTokens, ScheduledRequest, SchedulerOutput
from common.step_inputs import BatchLimits, InputBuffers, StepInputs

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_GB = 0.5


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged cache; also the layout part of a KV store fingerprint."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


class StepResult:
    """The sampled tokens of one step. On CUDA their copy to pinned host memory starts at once;
    ``tokens()`` is the step's single wait for the device."""

    def __init__(self, sampled: SamplerOutput, rows: list[SampleRow], owners: list[str]):
        self.rows, self.owners = rows, owners
        tensors = [t for t in sampled if t is not None]
        self._event: torch.cuda.Event | None = None
        if tensors and tensors[0].device.type == "cuda":
            tensors = [_to_pinned(t) for t in tensors]
            self._event = torch.cuda.Event()
            self._event.record()
        it = iter(tensors)
        self._host = SamplerOutput._make(next(it) if t is not None else None for t in sampled)

    def tokens(self) -> dict[str, SampledTokens]:
        if self._event is not None:
            self._event.synchronize()
        result = self._host
        token_ids = result.token_ids.tolist()
        lps = _to_token_logprobs(result, token_ids, self.rows)
        out: dict[str, SampledTokens] = {}
        for i, owner in enumerate(self.owners):
            entry = out.setdefault(owner, SampledTokens([], [] if lps is not None else None))
            entry.token_ids.append(token_ids[i])
            if lps is not None and entry.logprobs is not None:
                entry.logprobs.append(lps[i])
        return out


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
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
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
        )
        a = self.model.args
        self.vocab_size = a.vocab_size
        self.block_size = cache_config.block_size
        self.max_model_len = max_model_len
        self.spec = KVCacheSpec(
            a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.dtype
        )
        blocks_per_seq = -(-max_model_len // self.block_size)
        self.inputs = InputBuffers(
            BatchLimits(
                max_tokens=max(config.max_num_batched_tokens, config.max_num_seqs),
                max_seqs=config.max_num_seqs,
                max_samples=config.max_num_seqs,  # n samples take n seats
                max_blocks_per_seq=blocks_per_seq,
            ),
            self.block_size,
            self.device,
        )
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = DecodeGraphs.for_runner(self, capture=True)
        self.num_blocks = self._num_blocks(cache_config)
        # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): see ARCHITECTURE.md
        shape = (a.num_layers, 2, self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = zeros_on_huge_pages(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_layers = list(self.kv_cache.unbind(0))  # per-layer views, made once
        if self.graphs is not None:
            self.graphs.capture_all(self.kv_layers)
        self.connector: KVConnectorWorker | None = None
        self.hooks: LayerHooks | None = None
        # the last step's sampled ids (device) and each request's row in them: a token still
        # in flight is read from here by the next step (see common/step_inputs.py)
        self._prev_sampled: torch.Tensor | None = None
        self._prev_rows: dict[str, int] = {}

    def set_connector(self, connector: KVConnectorWorker) -> None:
        self.connector = connector
        self.hooks = ConnectorHooks(connector)

    def _num_blocks(self, cfg: CacheConfig) -> int:
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            from common.memory_profile import cuda_kv_budget

            budget = cuda_kv_budget(self, cfg.gpu_memory_utilization)
        else:
            budget = _CPU_DEFAULT_KV_GB * 2**30
        return max(1, int(budget // self.spec.bytes_per_block))

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult | None:
        """Launch one step. Returns its sampled tokens (still on their way) or None."""
        self._copy_blocks(out.block_copies)
        hidden, inputs = self._forward(out)
        if not inputs.num_logits_rows:
            return None  # a step of prompt chunks only: nothing sampled
        logits = self.model.compute_logits(hidden.index_select(0, inputs.logits_rows))
        rows, owners = self._sample_rows(out.scheduled)
        sampled = self.sampler.sample(logits, rows)
        self._remember(sampled.token_ids, owners)
        return StepResult(sampled, rows, owners)

    def _forward(self, out: SchedulerOutput) -> tuple[torch.Tensor, StepInputs]:
        connector = self.connector
        if connector is not None:
            assert isinstance(out.connector_meta, ConnectorMetadata)
            connector.bind_connector_metadata(out.connector_meta)
            connector.start_load_kv(self.kv_cache)
        try:
            hooked = connector is not None and connector.layer_work_pending()
            size = None if hooked or self.graphs is None else self.graphs.size_for(out.scheduled)
            stride = self.graphs.row_stride if size is not None else None  # type: ignore[union-attr]
            inputs = self.inputs.prepare(
                out.scheduled, self._prev_rows, padded_seqs=size, row_stride=stride
            )
            if inputs.num_fill:
                assert self._prev_sampled is not None
                self.inputs.fill_from(inputs, self._prev_sampled)
            if size is not None:
                hidden = self.graphs.replay(size, inputs)  # type: ignore[union-attr]
            else:
                inputs.meta.hooks = self.hooks if hooked else None
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_layers, inputs.meta)
            if connector is not None:
                connector.wait_for_save()
        finally:
            if connector is not None:
                connector.clear_connector_metadata()
        return hidden, inputs

    def start_loads(self, meta: ConnectorMetadata) -> None:
        """A step with nothing to compute may still have remote loads to start."""
        if self.connector is not None and meta.loads:
            self.connector.bind_connector_metadata(meta)
            self.connector.start_load_kv(self.kv_cache)
            self.connector.clear_connector_metadata()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = to_device([s for s, _ in copies], torch.int64, self.device)
            dst = to_device([d for _, d in copies], torch.int64, self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _remember(self, token_ids: torch.Tensor, owners: list[str]) -> None:
        rows: dict[str, int] = {}
        for i, owner in enumerate(owners):
            rows.setdefault(owner, i)
        self._prev_sampled, self._prev_rows = token_ids, rows

    def _sample_rows(self, scheduled: list[ScheduledRequest]):
        """One row per sample; a request forking into ``n`` samples gets ``n`` rows. A row's
        position counts the outputs still in flight before it (its own is the last one)."""
        rows: list[SampleRow] = []
        owners: list[str] = []
        for s in scheduled:
            r = s.request
            position = r.num_output_tokens + r.num_output_placeholders - 1
            for i in range(s.num_samples):
                seed = r.seed if i == 0 else r.child_seeds[i - 1]
                rows.append(
                    SampleRow(
                        r.sampling_params,
                        seed,
                        position,
                        r.prompt_token_ids,
                        r.output_token_ids,
                        r.eos_token_id,
                    )
                )
                owners.append(r.request_id)
        return rows, owners


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
