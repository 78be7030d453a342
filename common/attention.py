"""Attention over the paged KV cache: one layout, three backends behind one interface.

Cache layout (see docs/ARCHITECTURE.md): the whole cache is one tensor
``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``; a layer sees
``(2, num_blocks, block_size, num_kv_heads, head_dim)``. Each layer first writes the step's new K/V
into their slots (the model's fused rotary op does it, ``kernels/rotary.py``), then attends over
everything in the cache, so prefix hits and earlier prompt chunks need no special case.

- ``TorchAttentionBackend``: plain PyTorch, runs anywhere; it is the reference.
- ``CpuAttentionBackend``: the torch path with decode rows handed to the native C kernel of
  ``kernels/cpu_attention.py``, which reads the blocks in place (the default on CPU).
- ``TritonAttentionBackend``: the kernels of ``kernels/`` by row kind (``common/attention_plan.py``;
  CUDA, or CPU under TRITON_INTERPRET=1), FlashAttention for fresh prompts on CUDA.
"""

from __future__ import annotations

import inspect
from functools import cache
from typing import Protocol

import torch
import torch.nn.functional as F

from common.attention_metadata import AttentionMetadata, LayerHooks  # noqa: F401 - re-exported
from common.attention_plan import RowTensors, StepLaunch, step_launch

try:  # FlashAttention-2 varlen (torch >= 2.11: ``scale`` and ``window_size``; 2.12 adds GQA)
    from torch.nn.attention.varlen import varlen_attn

    if not {"scale", "window_size"} <= inspect.signature(varlen_attn).parameters.keys():
        varlen_attn = None  # torch 2.10's first form: no scale, so chunks take the Triton kernel
except ImportError:  # pragma: no cover - older torch: chunks all take the Triton kernel
    varlen_attn = None


class AttentionBackend(Protocol):
    name: str

    def attend(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Causal attention of ``query (T, H, D)`` over the cache. Returns ``(T, H, D)``."""


class TorchAttentionBackend:
    """Reference path: gathers each sequence's blocks and calls SDPA (batched for decodes).

    The gather lands in a reused workspace (``index_select(out=)``): fresh multi-megabyte
    tensors every layer would spend more time in page faults than in the copy itself. Decode
    rows are grouped by length so padding to the group's longest row wastes at most a quarter.
    """

    name = "torch"
    GROUP_SLACK = 0.75  # a row joins a group while its length >= 0.75 x the group's longest

    def __init__(self) -> None:
        self._workspace: torch.Tensor | None = None

    def attend(self, query, kv_layer, meta, scale) -> torch.Tensor:
        out = torch.empty_like(query)
        decode_rows = [i for i, n in enumerate(meta.query_lens) if n == 1]
        starts = meta.query_starts_cpu
        for rows in self._length_groups(decode_rows, meta.seq_lens_cpu):
            idx = torch.tensor([starts[i] for i in rows], device=query.device)
            out[idx] = self._decode(query[idx], kv_layer, meta, rows, scale)
        self._attend_prefills(out, query, kv_layer, meta, scale)
        return out

    def _attend_prefills(self, out, query, kv_layer, meta, scale) -> None:
        """Rows of the sequences with more than one query token (prefill chunks), into ``out``."""
        if meta.max_query_len <= 1:
            return
        starts = meta.query_starts_cpu
        for i, n in enumerate(meta.query_lens):
            if n > 1:
                lo = starts[i]
                out[lo : lo + n] = self._prefill(query[lo : lo + n], kv_layer, meta, i, scale)

    def _length_groups(self, rows: list[int], lens: list[int]) -> list[list[int]]:
        groups: list[list[int]] = []
        for i in sorted(rows, key=lambda r: -lens[r]):
            if groups and lens[i] >= self.GROUP_SLACK * lens[groups[-1][0]]:
                groups[-1].append(i)
            else:
                groups.append([i])
        return groups

    def _gather(self, kv_layer, tables: torch.Tensor, length: int, dtype: torch.dtype):
        """K, V of ``tables (S, nb)`` in ``dtype``: ``(S, nb * block_size, Hkv, D)`` views of
        the workspace, cut to ``length`` tokens (copies when an FP8 cache is widened)."""
        _, num_blocks, bs, hkv, d = kv_layer.shape
        flat = kv_layer.view(2, num_blocks, bs * hkv * d)
        ids = tables.reshape(-1).long()
        ws = self._space(2 * ids.numel() * bs * hkv * d, kv_layer)
        k = ws[: ids.numel() * bs * hkv * d].view(ids.numel(), -1)
        v = ws[ids.numel() * bs * hkv * d :].view(ids.numel(), -1)
        torch.index_select(flat[0], 0, ids, out=k)
        torch.index_select(flat[1], 0, ids, out=v)
        shape = (*tables.shape[:-1], tables.shape[-1] * bs, hkv, d)
        k, v = k.view(shape)[..., :length, :, :], v.view(shape)[..., :length, :, :]
        if dtype != kv_layer.dtype:  # an FP8 cache: widened to the queries' dtype (exact)
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    def _space(self, numel: int, like: torch.Tensor) -> torch.Tensor:
        ws = self._workspace
        if ws is None or ws.numel() < numel or ws.dtype != like.dtype or ws.device != like.device:
            ws = self._workspace = torch.empty(
                int(numel * 1.25), dtype=like.dtype, device=like.device
            )
        return ws[:numel]

    def _prefill(self, q, kv_layer, meta, seq: int, scale: float) -> torch.Tensor:
        seq_len, q_len = meta.seq_lens_cpu[seq], meta.query_lens[seq]
        num_blocks = -(-seq_len // kv_layer.shape[2])
        k, v = self._gather(kv_layer, meta.block_tables[seq, :num_blocks], seq_len, q.dtype)
        mask = None
        if q_len != seq_len:  # queries sit at the end of the context
            pos_q = torch.arange(seq_len - q_len, seq_len, device=q.device)
            mask = pos_q[:, None] >= torch.arange(seq_len, device=q.device)[None, :]
        # NOTE: 4-D inputs on purpose: on CPU, 3-D ones take SDPA's unfused math path (the
        # whole score matrix materialised), 4-5x slower than the flash kernel at 512 tokens.
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # (1, H, q_len, D)
            k.transpose(0, 1)[None],  # (1, Hkv, seq_len, D)
            v.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return o[0].transpose(0, 1)

    def _decode(self, q, kv_layer, meta, rows: list[int], scale: float) -> torch.Tensor:
        lens = [meta.seq_lens_cpu[i] for i in rows]
        max_len = max(lens)
        num_blocks = -(-max_len // kv_layer.shape[2])
        tables = meta.block_tables[rows, :num_blocks]
        k, v = self._gather(kv_layer, tables, max_len, q.dtype)  # (S, L, Hkv, D)
        mask = None
        if min(lens) < max_len:
            lens_t = torch.tensor(lens, device=q.device)
            mask = torch.arange(max_len, device=q.device)[None, :] < lens_t[:, None]  # (S, L)
            mask = mask[:, None, None, :]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # (S, H, 1, D)
            k.transpose(1, 2),  # (S, Hkv, L, D)
            v.transpose(1, 2),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return o.squeeze(2)


class CpuAttentionBackend(TorchAttentionBackend):
    """CPU: decode rows by the native kernel (blocks read in place, one call per layer for the
    whole batch), prefill chunks by the torch path's SDPA (compute-bound, where SDPA's blocked
    GEMMs beat a hand loop). Dtypes the kernel lacks (float16) take the torch path."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        import kernels.ops  # noqa: F401 - registers torch.ops.pdserve.*
        from kernels import cpu_attention

        if cpu_attention.load_library() is None:
            raise RuntimeError(f"native CPU attention unavailable: {cpu_attention.load_error()}")
        self._kernel = torch.ops.pdserve.paged_decode_attention_cpu  # one dispatched op
        self._dtypes = cpu_attention.supported_dtypes()

    def attend(self, query, kv_layer, meta, scale) -> torch.Tensor:
        if query.dtype not in self._dtypes:
            return super().attend(query, kv_layer, meta, scale)
        out = self._kernel(
            query,
            kv_layer,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_seq_len,
            scale,
        )
        self._attend_prefills(out, query, kv_layer, meta, scale)
        return out


class TritonAttentionBackend:
    """The Triton kernels of ``kernels/`` (CUDA; CPU only under ``TRITON_INTERPRET=1``), by row
    kind (:func:`step_launch`): one-token rows to the split-K decode kernel, prompts with no
    cached context to FlashAttention (torch's varlen flash kernel, CUDA and half dtypes only),
    other chunks to the GQA-packed paged prefill kernel. A pure-decode step (every CUDA graph)
    is one decode launch over the step's own buffers.

    ``flash``: ``None`` decides per step (CUDA, fp16/bf16, torch's varlen API present);
    ``True``/``False`` force it (tests).
    """

    name = "triton"

    def __init__(self, flash: bool | None = None) -> None:
        import kernels  # imported lazily: CPU-only users never need triton
        from kernels.paged_decode_attention import num_sms

        self._k = kernels
        self._num_sms = num_sms
        self._flash = flash

    def attend(self, query, kv_layer, meta, scale) -> torch.Tensor:
        if meta.max_query_len == 1:
            return self._k.paged_decode_attention(
                query, kv_layer, meta.block_tables, meta.seq_lens, scale,
                max_seq_len=meta.max_seq_len,
            )  # fmt: skip
        launch, rows = self._step(query, kv_layer, meta)
        out = torch.zeros_like(query)
        if launch.decode_rows:
            self._decode(out, query, kv_layer, launch, rows, scale)
        if launch.flash_rows:
            _flash_prefill(out, query, kv_layer, rows, launch.flash_max_len, scale)
        if launch.tiles:
            self._k.paged_prefill_attention(
                query, kv_layer, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                launch.prefill_max_query_len, scale, tiles=rows.tiles, out=out,
            )  # fmt: skip
        return out

    def _decode(self, out, query, kv_layer, launch: StepLaunch, rows: RowTensors, scale) -> None:
        o = self._k.paged_decode_attention(
            query.index_select(0, rows.decode_tokens), kv_layer, rows.decode_tables,
            rows.decode_seq_lens, scale, plan=launch.decode_plan,
        )  # fmt: skip
        out.index_copy_(0, rows.decode_tokens, o)

    def _step(self, query, kv_layer, meta: AttentionMetadata) -> tuple[StepLaunch, RowTensors]:
        """The step's launch and its device index tensors, built by the first layer."""
        if "triton" not in meta.step_cache:
            flash = self._flash
            if flash is None:
                flash = query.is_cuda and query.dtype != torch.float32 and varlen_attn is not None
            _, _, block_size, num_kv_heads, _ = kv_layer.shape
            shape = (query.shape[1], num_kv_heads)
            launch = step_launch(meta, *shape, flash, self._num_sms(query.device))
            meta.step_cache["triton"] = (launch, RowTensors.build(launch, meta, block_size))
        return meta.step_cache["triton"]


@cache
def _takes_gqa(fn) -> bool:
    """Whether torch's varlen kernel takes fewer K/V heads than query heads (torch >= 2.12)."""
    return "enable_gqa" in inspect.signature(fn).parameters


def _flash_prefill(out, query, kv_layer, rows: RowTensors, max_len: int, scale) -> None:
    """Causal FlashAttention of prompts with no cached context: their K/V gathered from the
    layer's cache (just written by the rotary op) into packed ``(Tf, Hkv, D)``."""
    _, _, _, num_kv_heads, head_dim = kv_layer.shape
    k = kv_layer[0].reshape(-1, num_kv_heads, head_dim).index_select(0, rows.flash_slots)
    v = kv_layer[1].reshape(-1, num_kv_heads, head_dim).index_select(0, rows.flash_slots)
    k, v = k.to(query.dtype), v.to(query.dtype)  # an FP8 cache widened (else no copy)
    q, cu = query.index_select(0, rows.flash_tokens), rows.flash_cu_seqlens
    gqa = {"enable_gqa": True} if _takes_gqa(varlen_attn) else {}
    if not gqa and num_kv_heads != q.shape[1]:  # torch 2.11's kernel wants equal head counts
        k, v = (t.repeat_interleave(q.shape[1] // num_kv_heads, dim=1) for t in (k, v))
    o = varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0), **gqa)
    out.index_copy_(0, rows.flash_tokens, o)


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto``: Triton on CUDA; on CPU the native kernel, or PyTorch when it cannot be built.
    ``cpu``/``torch``/``triton`` force one."""
    if name == "auto":
        if device.type == "cuda":
            return TritonAttentionBackend()
        from kernels import cpu_attention

        name = "cpu" if cpu_attention.load_library() is not None else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention backend 'cpu' needs a CPU device, got {device}")
        return CpuAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}")
