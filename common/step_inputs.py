"""One step's flat model inputs, written on the host into persistent buffers and moved to the
device in two copies: no allocation, no host sync, fixed addresses (what CUDA graphs replay).

NOTE: the layout. Every array of a step lives at a fixed offset of one of two flat buffers, one
per dtype; the host twin is pinned on CUDA, and on CPU the host buffers are the device buffers.

```
int64  [ token ids : T ][ positions : T ][ slot mapping : T ][ logits rows : T ][ fill : 2T ]
int32  [ query_start_loc : S+1 ][ seq lens : S ][ block tables : S x row stride ]
         T = max_num_batched_tokens, S = max_num_seqs (a sequence verifying speculative
         drafts samples every one of its tokens: up to T logits rows)
```

The block tables' row stride is the step's widest table (eager steps), or a fixed width for a
captured decode graph. "fill" lists tokens whose id is still on the device (sampled by the step
in flight, see the scheduler's NOTE): ``input_ids[fill_dst[i]] = previous_sampled[fill_src[i]]``
runs on the device before the forward pass.

Two host sets alternate, so writing step N+1 never races the copy of step N still in flight.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.attention import AttentionMetadata
from common.step_outputs import ScheduledRequest


@dataclass(frozen=True)
class BatchLimits:
    """The largest step the buffers hold."""

    max_tokens: int  # tokens per step (max_num_batched_tokens, or more for padded graphs)
    max_seqs: int  # sequences per step
    max_blocks_per_seq: int  # block table width for max_model_len


class StepInputs(NamedTuple):
    """Device views of one step's inputs (valid until the next ``prepare``)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # (R,) int64: hidden rows to sample (k + 1 with k drafts)
    num_logits_rows: int
    num_fill: int  # tokens to take from the previous step's sampled ids


class _Offsets(NamedTuple):
    tokens: int
    positions: int
    slots: int
    logits_rows: int
    fill: int
    int64_size: int
    seq_lens: int
    block_tables: int
    int32_size: int


def _offsets(lim: BatchLimits) -> _Offsets:
    t, s = lim.max_tokens, lim.max_seqs
    return _Offsets(
        tokens=0,
        positions=t,
        slots=2 * t,
        logits_rows=3 * t,
        fill=4 * t,
        int64_size=6 * t,
        seq_lens=s + 1,
        block_tables=2 * s + 1,
        int32_size=2 * s + 1 + s * lim.max_blocks_per_seq,
    )


class InputBuffers:
    """Persistent input buffers of one model runner. Not thread-safe (the engine thread owns it).

    ``prepare`` takes the scheduler's plan and the previous step's sampled rows and returns
    device views; ``padded_seqs`` pads a pure-decode batch to a captured graph's size (padding
    rows: token 0 at position 0, slot -1, seq len 0, whose output is ignored).
    """

    def __init__(self, limits: BatchLimits, block_size: int, device: torch.device) -> None:
        self.limits, self.block_size, self.device = limits, block_size, device
        self.off = _offsets(limits)
        on_cuda = device.type == "cuda"
        self._host = [
            (
                torch.zeros(self.off.int64_size, dtype=torch.int64, pin_memory=on_cuda),
                torch.zeros(self.off.int32_size, dtype=torch.int32, pin_memory=on_cuda),
            )
            for _ in range(2 if on_cuda else 1)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._turn = itertools.cycle(range(len(self._host)))
        self.last_host = self._host[0]  # the host set of the latest step (TP broadcasts it)
        if on_cuda:
            self.int64 = torch.zeros(self.off.int64_size, dtype=torch.int64, device=device)
            self.int32 = torch.zeros(self.off.int32_size, dtype=torch.int32, device=device)
        else:
            self.int64, self.int32 = self._host[0]

    # -- fixed device views (what a captured graph reads) ---------------------------------------
    def views(self, num_tokens: int, num_seqs: int, row_stride: int) -> StepInputs:
        o = self.off
        meta = AttentionMetadata(
            query_start_loc=self.int32[: num_seqs + 1],
            seq_lens=self.int32[o.seq_lens : o.seq_lens + num_seqs],
            block_tables=self.int32[o.block_tables : o.block_tables + num_seqs * row_stride].view(
                num_seqs, row_stride
            ),
            slot_mapping=self.int64[o.slots : o.slots + num_tokens],
            query_lens=[],
            seq_lens_cpu=[],
            max_query_len=1,
            max_seq_len=row_stride * self.block_size,
        )
        return StepInputs(
            self.int64[o.tokens : o.tokens + num_tokens],
            self.int64[o.positions : o.positions + num_tokens],
            meta,
            self.int64[o.logits_rows : o.logits_rows],
            0,
            0,
        )

    def fill_padding(self, num_seqs: int, row_stride: int) -> None:
        """Device buffers of a ``num_seqs``-row decode step made entirely of padding rows (what a
        graph is captured on: valid addresses, no cache write, zero-length attention)."""
        o = self.off
        self.int64[o.tokens : o.tokens + num_seqs] = 0
        self.int64[o.positions : o.positions + num_seqs] = 0
        self.int64[o.slots : o.slots + num_seqs] = -1
        self.int32[: num_seqs + 1] = torch.arange(num_seqs + 1, dtype=torch.int32)
        self.int32[o.seq_lens : o.seq_lens + num_seqs] = 0
        self.int32[o.block_tables : o.block_tables + num_seqs * row_stride] = 0

    # -- one step -------------------------------------------------------------------------------
    def prepare(
        self,
        scheduled: list[ScheduledRequest],
        prev_rows: dict[str, int],
        *,
        padded_seqs: int | None = None,
        row_stride: int | None = None,
    ) -> StepInputs:
        """Write the step's inputs and start their copy to the device.

        ``prev_rows``: request id → its row in the previous step's sampled ids, for requests
        whose newest token is still on the device. ``padded_seqs``/``row_stride``: the shape of
        a captured decode graph (pure decode steps only).
        """
        k = next(self._turn)
        host64, host32 = self._host[k]
        event = self._copied[k]
        if event is not None:
            event.synchronize()  # the copy of two steps ago; long done in practice
        self.last_host = (host64, host32)
        h64, h32 = host64.numpy(), host32.numpy()
        batch = _HostBatch.build(scheduled, self.block_size, prev_rows)
        num_seqs = padded_seqs or len(scheduled)
        num_tokens = batch.num_tokens + (num_seqs - len(scheduled))
        stride = row_stride or batch.max_blocks
        self._check_fits(batch, num_tokens, num_seqs, stride)
        used32 = batch.write(h64, h32, self.off, num_tokens, num_seqs, stride)
        if self.device.type == "cuda":
            self.int64.copy_(host64, non_blocking=True)
            self.int32[:used32].copy_(host32[:used32], non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.device))  # this device's, by name
            self._copied[k] = copied
        views = self.views(num_tokens, num_seqs, stride)
        o = self.off
        meta = views.meta
        meta.query_lens = batch.query_lens + [1] * (num_seqs - len(scheduled))
        meta.seq_lens_cpu = batch.seq_lens + [0] * (num_seqs - len(scheduled))
        meta.max_query_len = max(meta.query_lens)
        meta.max_seq_len = row_stride * self.block_size if row_stride else max(batch.seq_lens)
        rows = len(batch.logits_rows)
        return views._replace(
            meta=meta,
            logits_rows=self.int64[o.logits_rows : o.logits_rows + rows],
            num_logits_rows=rows,
            num_fill=len(batch.fill_dst),
        )

    def adopt(
        self,
        num_tokens: int,
        num_seqs: int,
        stride: int,
        num_rows: int,
        max_query_len: int,
        max_seq_len: int,
    ) -> StepInputs:
        """A tensor-parallel worker's step: ``last_host`` already holds the host buffers rank 0
        prepared (eager, nothing to fill); copy them to the device and return the views."""
        host64, host32 = self.last_host
        o = self.off
        if self.device.type == "cuda":  # blocking: the next step's receive reuses the host set
            self.int64.copy_(host64)
            self.int32.copy_(host32)
        views = self.views(num_tokens, num_seqs, stride)
        h32 = host32.numpy()
        meta = views.meta
        meta.query_lens = np.diff(h32[: num_seqs + 1]).tolist()
        meta.seq_lens_cpu = h32[o.seq_lens : o.seq_lens + num_seqs].tolist()
        meta.max_query_len, meta.max_seq_len = max_query_len, max_seq_len
        rows = self.int64[o.logits_rows : o.logits_rows + num_rows]
        return views._replace(meta=meta, logits_rows=rows, num_logits_rows=num_rows)

    def fill_from(self, inputs: StepInputs, previous: torch.Tensor) -> None:
        """Put the ids still on the device (``previous``: last step's sampled ids) in place."""
        if not inputs.num_fill:
            return
        o, n = self.off, inputs.num_fill
        dst = self.int64[o.fill : o.fill + n]
        src = self.int64[o.fill + n : o.fill + 2 * n]
        inputs.input_ids.index_copy_(0, dst, previous.index_select(0, src))

    def _check_fits(self, batch: _HostBatch, num_tokens: int, num_seqs: int, stride: int) -> None:
        lim = self.limits
        if (
            num_tokens > lim.max_tokens
            or num_seqs > lim.max_seqs
            or stride > lim.max_blocks_per_seq
            or stride < batch.max_blocks
        ):
            raise ValueError(
                f"step of {num_tokens} tokens, {num_seqs} sequences, {batch.max_blocks} blocks"
                f" per sequence exceeds {lim}"
            )


@dataclass
class _HostBatch:
    """The step as host arrays (numpy), before they are written into the buffers."""

    tokens: np.ndarray  # (T,) int64; 0 where the id is still on the device
    positions: np.ndarray  # (T,)
    query_starts: np.ndarray  # (S+1,) int32
    seq_lens_np: np.ndarray  # (S,) int32
    table_rows: np.ndarray  # flat block ids, row by row
    table_cols: np.ndarray
    table_ids: np.ndarray
    owner: np.ndarray  # (T,) sequence of each token
    logits_rows: list[int]
    fill_dst: list[int]
    fill_src: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    max_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def build(
        scheduled: list[ScheduledRequest], block_size: int, prev_rows: dict[str, int]
    ) -> _HostBatch:
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, len(scheduled))
        q_lens = np.fromiter((s.num_new_tokens for s in scheduled), np.int64, len(scheduled))
        seq_lens = starts + q_lens
        qsl = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=qsl[1:])
        total = int(qsl[-1])
        owner = np.repeat(np.arange(len(scheduled)), q_lens)
        positions = np.arange(total, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        tokens, fill_dst, fill_src = _gather_tokens(scheduled, qsl, prev_rows, total)
        rows, cols, ids, widest = _flat_tables(scheduled)
        logits_rows = [
            row
            for i, s in enumerate(scheduled)
            if s.samples
            for row in range(int(qsl[i + 1]) - 1 - len(s.spec_token_ids), int(qsl[i + 1]))
        ]
        return _HostBatch(
            tokens,
            positions,
            qsl,
            seq_lens.astype(np.int32),
            rows,
            cols,
            ids,
            owner,
            logits_rows,
            fill_dst,
            fill_src,
            q_lens.tolist(),
            seq_lens.tolist(),
            widest,
            block_size,
        )

    def write(
        self,
        h64: np.ndarray,
        h32: np.ndarray,
        o: _Offsets,
        num_tokens: int,
        num_seqs: int,
        stride: int,
    ) -> int:
        """Fill the host buffers (padding rows included); returns the int32 elements used."""
        n, s = self.num_tokens, len(self.query_lens)
        h64[o.tokens : o.tokens + n] = self.tokens
        h64[o.positions : o.positions + n] = self.positions
        tables = h32[o.block_tables : o.block_tables + num_seqs * stride].reshape(num_seqs, stride)
        tables[self.table_rows, self.table_cols] = self.table_ids
        pos, bs = self.positions, self.block_size
        h64[o.slots : o.slots + n] = tables[self.owner, pos // bs].astype(np.int64) * bs + pos % bs
        pad = num_tokens - n
        if pad:  # padding rows of a captured graph: harmless inputs, outputs ignored
            h64[o.tokens + n : o.tokens + num_tokens] = 0
            h64[o.positions + n : o.positions + num_tokens] = 0
            h64[o.slots + n : o.slots + num_tokens] = -1
        r = len(self.logits_rows)
        h64[o.logits_rows : o.logits_rows + r] = self.logits_rows
        f = len(self.fill_dst)
        h64[o.fill : o.fill + f] = self.fill_dst
        h64[o.fill + f : o.fill + 2 * f] = self.fill_src
        h32[: s + 1] = self.query_starts
        h32[s + 1 : num_seqs + 1] = np.arange(n + 1, n + 1 + num_seqs - s, dtype=np.int32)
        h32[o.seq_lens : o.seq_lens + s] = self.seq_lens_np
        h32[o.seq_lens + s : o.seq_lens + num_seqs] = 0
        return o.block_tables + num_seqs * stride


def _gather_tokens(
    scheduled: list[ScheduledRequest], qsl: np.ndarray, prev_rows: dict[str, int], total: int
) -> tuple[np.ndarray, list[int], list[int]]:
    """Token ids of the step; a token sampled by the step in flight is left 0 and listed in
    (fill_dst, fill_src) instead."""
    tokens = np.empty(total, dtype=np.int64)
    fill_dst: list[int] = []
    fill_src: list[int] = []
    for i, s in enumerate(scheduled):
        r = s.request
        a, b = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
        lo = int(qsl[i])
        known = min(b, r.num_tokens)
        if b - a == 1 and known == b:
            tokens[lo] = r.all_token_ids[a]  # the common decode row: no slice, no array
        else:
            tokens[lo : lo + known - a] = r.all_token_ids[a:known]
        if s.spec_token_ids:  # drafts to verify follow the request's newest token
            tokens[lo + known - a : lo + b - a] = s.spec_token_ids
        elif known < b:  # exactly one: the token the previous step sampled for this request
            assert b - known == 1, (r.request_id, a, b, r.num_tokens)
            tokens[lo + known - a] = 0
            fill_dst.append(lo + known - a)
            fill_src.append(prev_rows[r.request_id])
    return tokens, fill_dst, fill_src


def _flat_tables(
    scheduled: list[ScheduledRequest],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(rows, cols, ids) of every block table entry, built in one pass; and the widest table."""
    lens = [len(s.block_ids) for s in scheduled]
    total = sum(lens)
    ids = np.fromiter(
        itertools.chain.from_iterable(s.block_ids for s in scheduled), np.int32, total
    )
    lens_np = np.asarray(lens, dtype=np.int64)
    rows = np.repeat(np.arange(len(scheduled)), lens_np)
    starts = np.repeat(np.cumsum(lens_np) - lens_np, lens_np)
    cols = np.arange(total) - starts
    return rows, cols, ids, max(lens)
