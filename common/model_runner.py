"""The model runner: the only component that builds tensors.

Per step it turns the scheduler's plan into one flat batch (token ids, positions, slot mapping,
block tables, query/sequence lengths), runs the model once over every scheduled token of every
request (prefill chunks and decodes mixed), computes logits only for rows that need a next token
and samples them in one batched call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.attention import AttentionMetadata, LayerHooks, get_attention_backend
from common.config import CacheConfig
from common.host_memory import keep_freed_host_memory, zeros_on_huge_pages
from common.kv_connector import ConnectorHooks, ConnectorMetadata, KVConnectorWorker
from common.models.llama import LlamaForCausalLM
from common.models.loader import build_model, resolve_dtype
from common.request import TokenLogprobs
from common.sampler import Sampler, SamplerOutput, SampleRow
from common.scheduler import SampledTokens, ScheduledRequest, SchedulerOutput

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


class ModelRunner:
    """Owns the model, the KV cache tensor and the sampler of one engine."""

    def __init__(
        self,
        model_dir: Path,
        hf_config: dict[str, Any],
        *,
        dtype: str,
        device: str,
        attention_backend: str,
        cache_config: CacheConfig,
        max_model_len: int,
        load_format: str = "auto",
        seed: int = 0,
    ) -> None:
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            keep_freed_host_memory()  # process-wide; see common/host_memory.py
        self.dtype = resolve_dtype(dtype, hf_config)
        self.backend = get_attention_backend(attention_backend, self.device)
        self.model: LlamaForCausalLM = build_model(
            model_dir,
            hf_config,
            self.dtype,
            self.device,
            self.backend,
            max_model_len,
            load_format,
            seed,
        )
        a = self.model.args
        self.vocab_size = a.vocab_size
        self.block_size = cache_config.block_size
        self.spec = KVCacheSpec(
            a.num_layers, a.num_kv_heads, a.head_dim, self.block_size, self.dtype
        )
        self.num_blocks = self._num_blocks(cache_config)
        # (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim): see ARCHITECTURE.md
        shape = (a.num_layers, 2, self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        if self.device.type == "cpu":
            self.kv_cache = zeros_on_huge_pages(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.sampler = Sampler()
        self.connector: KVConnectorWorker | None = None
        self.hooks: LayerHooks | None = None

    def set_connector(self, connector: KVConnectorWorker) -> None:
        self.connector = connector
        self.hooks = ConnectorHooks(connector)

    def _num_blocks(self, cfg: CacheConfig) -> int:
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if cfg.kv_cache_memory_gb is not None:
            budget = cfg.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.gpu_memory_utilization - 2 * 2**30  # room for activations
        else:
            budget = _CPU_DEFAULT_KV_GB * 2**30
        return max(1, int(budget // self.spec.bytes_per_block))

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledTokens]:
        self._copy_blocks(out.block_copies)
        input_ids, positions, meta, logits_rows = self._prepare(out.scheduled)
        if self.connector is None:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
        else:
            hidden = self._forward_with_connector(input_ids, positions, meta, out)
        if not logits_rows:
            return {}
        logits = self.model.compute_logits(hidden[logits_rows])
        rows, owners = self._sample_rows(out.scheduled)
        counts = [s.num_samples for s in out.scheduled if s.num_samples]
        if len(rows) != len(counts):  # a request forking into n samples: n rows of its logits
            logits = logits.repeat_interleave(torch.tensor(counts, device=self.device), dim=0)
        return self._collect(self.sampler.sample(logits, rows), rows, owners)

    def _forward_with_connector(self, input_ids, positions, meta, out: SchedulerOutput):
        assert self.connector is not None and isinstance(out.connector_meta, ConnectorMetadata)
        self.connector.bind_connector_metadata(out.connector_meta)
        self.connector.start_load_kv(self.kv_cache)
        meta.hooks = self.hooks
        try:
            hidden = self.model(input_ids, positions, self.kv_cache, meta)
            self.connector.wait_for_save()
        finally:
            self.connector.clear_connector_metadata()
        return hidden

    def start_loads(self, meta: ConnectorMetadata) -> None:
        """A step with nothing to compute may still have remote loads to start."""
        if self.connector is not None and meta.loads:
            self.connector.bind_connector_metadata(meta)
            self.connector.start_load_kv(self.kv_cache)
            self.connector.clear_connector_metadata()

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.device)
            dst = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _prepare(self, scheduled: list[ScheduledRequest]):
        """Flat inputs for the batch. Vectorised per request with numpy; no per-token Python."""
        bs = self.block_size
        starts = np.array([s.request.num_computed_tokens for s in scheduled], dtype=np.int64)
        q_lens = np.array([s.num_new_tokens for s in scheduled], dtype=np.int64)
        seq_lens = starts + q_lens
        positions = np.concatenate([np.arange(a, b) for a, b in zip(starts, seq_lens)])
        tokens = np.concatenate(
            [s.request.all_token_ids[a:b] for s, a, b in zip(scheduled, starts, seq_lens)]
        )
        max_blocks = max(len(s.block_ids) for s in scheduled)
        tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            tables[i, : len(s.block_ids)] = s.block_ids
        owner = np.repeat(np.arange(len(scheduled)), q_lens)
        slots = tables[owner, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        logits_rows = [int(qsl[i + 1]) - 1 for i, s in enumerate(scheduled) if s.num_samples]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(qsl).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_lens=q_lens.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = torch.from_numpy(tokens.astype(np.int64)).to(dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta, logits_rows

    def _sample_rows(self, scheduled: list[ScheduledRequest]):
        """One row per sample; a request forking into ``n`` samples gets ``n`` rows."""
        rows: list[SampleRow] = []
        owners: list[str] = []
        for s in scheduled:
            r = s.request
            for i in range(s.num_samples):
                seed = r.seed if i == 0 else r.child_seeds[i - 1]
                rows.append(
                    SampleRow(
                        r.sampling_params,
                        seed,
                        r.num_output_tokens,
                        r.prompt_token_ids,
                        r.output_token_ids,
                        r.eos_token_id,
                    )
                )
                owners.append(r.request_id)
        return rows, owners

    def _collect(
        self, result: SamplerOutput, rows: list[SampleRow], owners: list[str]
    ) -> dict[str, SampledTokens]:
        token_ids = result.token_ids.tolist()
        lps = _to_token_logprobs(result, token_ids, rows)
        out: dict[str, SampledTokens] = {}
        for i, owner in enumerate(owners):
            entry = out.setdefault(owner, SampledTokens([], [] if lps is not None else None))
            entry.token_ids.append(token_ids[i])
            if lps is not None and entry.logprobs is not None:
                entry.logprobs.append(lps[i])
        return out


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
