"""Which kernel serves which rows of a step on the Triton backend, and what that costs.

NOTE: a step with a prefill chunk used to send every row through the prefill kernel: one
program per 64-query tile per sequence per head, so a decode row (one query) took a whole tile
and read its K/V once per query head. Now rows go by kind (:func:`step_launch`):

```
row kind                           kernel                              programs
query_len == 1 (decode, verify 1)  paged_decode_attention (split-K)    (Sd, Hkv, splits)
fresh prompt, on CUDA              FlashAttention-2 varlen (torch)     its own
chunk over a cached prefix         paged_prefill_attention (GQA tiles) (q tiles, Hkv)
```

The split is made on the host from the step's lists (a mixed step is always eager; a CUDA graph
is pure decode and takes one decode launch), once per step, and every layer reuses it.
:func:`launch_stats` counts programs and K/V bytes from the same :class:`StepLaunch` the
backend executes, so the figures in docs/BENCHMARKS.md are those of the real routing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from common.attention_metadata import AttentionMetadata
    from kernels.paged_decode_attention import DecodePlan
    from kernels.paged_prefill_attention import PrefillPlan


class StepLaunch(NamedTuple):
    """Which kernel serves each row of a step with a prefill chunk (host ints; every layer
    launches the same). Rows are indices into the step's sequences."""

    decode_rows: list[int]  # one query token: paged_decode_attention
    decode_plan: DecodePlan | None
    flash_rows: list[int]  # prompts with no cached context, on CUDA: FlashAttention
    flash_max_len: int
    prefill_rows: list[int]  # the other chunks: paged_prefill_attention
    prefill_max_query_len: int
    tiles: list[int]  # the prefill kernel's q tiles (kernels.paged_prefill_attention)
    prefill_plan: PrefillPlan | None


def step_launch(
    meta: AttentionMetadata, num_heads: int, num_kv_heads: int, flash: bool, num_sms: int
) -> StepLaunch:
    """Rows split by kind, and each kernel's plan, from the step's host lists."""
    from kernels.paged_decode_attention import decode_plan
    from kernels.paged_prefill_attention import prefill_plan, prefill_tiles

    q_lens, seq_lens = meta.query_lens, meta.seq_lens_cpu
    decode = [i for i, n in enumerate(q_lens) if n == 1]
    chunks = [i for i, n in enumerate(q_lens) if n > 1]
    is_fresh = [flash and q_lens[i] == seq_lens[i] for i in chunks]
    fresh = [i for i, f in zip(chunks, is_fresh, strict=True) if f]
    cached = [i for i, f in zip(chunks, is_fresh, strict=True) if not f]
    d_plan = None
    if decode:
        d_max = max(seq_lens[i] for i in decode)
        d_plan = decode_plan(len(decode), num_kv_heads, d_max, num_sms)
    p_max = max((q_lens[i] for i in cached), default=0)
    p_plan = prefill_plan(p_max, num_heads // num_kv_heads) if cached else None
    tiles = prefill_tiles(q_lens, cached, p_plan.block_q) if p_plan else []
    f_max = max((q_lens[i] for i in fresh), default=0)
    return StepLaunch(decode, d_plan, fresh, f_max, cached, p_max, tiles, p_plan)


class StepLaunchStats(NamedTuple):
    """Programs and K/V traffic of one layer's Triton launches (FlashAttention's not counted)."""

    programs: int
    programs_with_work: int
    decode_kv_bytes: int
    prefill_kv_bytes: int


def launch_stats(
    launch: StepLaunch,
    meta: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
) -> StepLaunchStats:
    """What :class:`TritonAttentionBackend` launches per layer for ``launch``."""
    from kernels.paged_decode_attention import decode_launch_stats
    from kernels.paged_prefill_attention import prefill_launch_stats

    shape = (num_kv_heads, head_dim, dtype_bytes)
    seq_lens = meta.seq_lens_cpu
    programs = with_work = decode_bytes = prefill_bytes = 0
    if launch.decode_plan is not None:
        lens = [seq_lens[i] for i in launch.decode_rows]
        d = decode_launch_stats(lens, num_heads, *shape, launch.decode_plan)
        programs, with_work, decode_bytes = d.programs, d.programs_with_keys, d.kv_bytes
    if launch.prefill_plan is not None:
        p = prefill_launch_stats(
            launch.tiles, meta.query_lens, seq_lens, *shape, launch.prefill_plan
        )
        programs, with_work = programs + p.programs, with_work + p.programs  # all have queries
        prefill_bytes = p.kv_bytes
    return StepLaunchStats(programs, with_work, decode_bytes, prefill_bytes)


class RowTensors(NamedTuple):
    """The device side of a :class:`StepLaunch`, built once per step."""

    decode_tokens: torch.Tensor  # (Sd,) int64: each decode row's token in the step
    decode_tables: torch.Tensor  # (Sd, max_blocks) int32
    decode_seq_lens: torch.Tensor  # (Sd,) int32
    flash_tokens: torch.Tensor  # (Tf,) int64: the fresh prompts' tokens, in order
    flash_slots: torch.Tensor  # (Tf,) int64: their K/V slots in a layer's cache
    flash_cu_seqlens: torch.Tensor  # (Nf+1,) int32
    tiles: torch.Tensor  # (n, 2) int32

    @staticmethod
    def build(launch: StepLaunch, meta: AttentionMetadata, block_size: int) -> RowTensors:
        starts, q_lens = meta.query_starts_cpu, meta.query_lens
        # A fresh prompt's token j sits at position j of its sequence: per-token indices by
        # numpy repeats (a prompt's thousands of tokens never pass through a Python loop).
        lens = np.asarray([q_lens[i] for i in launch.flash_rows], dtype=np.int64)
        cu = np.concatenate(([0], np.cumsum(lens)))
        pos = np.arange(cu[-1], dtype=np.int64) - np.repeat(cu[:-1], lens)
        first = np.asarray([starts[i] for i in launch.flash_rows], dtype=np.int64)
        rows, tokens, seqs, pos, flash_tokens, cu, tiles = upload(
            [
                np.asarray(launch.decode_rows, dtype=np.int64),
                np.asarray([starts[i] for i in launch.decode_rows], dtype=np.int64),
                np.repeat(np.asarray(launch.flash_rows, dtype=np.int64), lens),
                pos,
                np.repeat(first, lens) + pos,
                cu,
                np.asarray(launch.tiles, dtype=np.int64),
            ],
            meta.seq_lens.device,
        )
        blocks = meta.block_tables[seqs, pos // block_size].long()
        return RowTensors(
            tokens,
            meta.block_tables.index_select(0, rows),
            meta.seq_lens.index_select(0, rows),
            flash_tokens,
            blocks * block_size + pos % block_size,
            cu.to(torch.int32),
            tiles.to(torch.int32).view(-1, 2),
        )


def upload(parts: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """Host int64 arrays on ``device`` through one copy (``common.sampler.to_device``: pinned
    and asynchronous on CUDA, so building a step's rows never waits for the steps queued before
    it). Slices of one buffer come back, in order."""
    from common.sampler import to_device

    flat = to_device(np.concatenate(parts), torch.int64, device)
    return list(flat.split([len(p) for p in parts]))
