"""One step's flat model inputs, written on the host into persistent buffers and moved to the
device in two copies: no allocation, no host sync, fixed addresses (what CUDA graphs replay).

NOTE: the layout. Every array of a step lives at a fixed offset of one of two flat buffers, one
per dtype; the host twin is pinned on CUDA, and on CPU the host buffers are the device buffers.

```
int64  [ token ids : T ][ positions : T ][ slot mapping : T ][ logits rows : T ][ fill : 2T ]
int32  [ query_start_loc : S+1 ][ seq lens : S ][ table rows : S ][ table changes : 2 S W ]
       [ block tables : S x row stride ]  (device only: gathered there from the table rows)
         T = max_num_batched_tokens, S = max_num_seqs, W = blocks of max_model_len (a sequence
         verifying speculative drafts samples every one of its tokens: up to T logits rows)
```

Block tables are not rebuilt each step: every request keeps a row of its block ids on the host
and on the device (``common/block_table.py``); a step stages only the ids that changed, as
``(flat index, id)`` pairs that the device applies to its rows, and the device gathers the step's
table from its rows (``table rows``: each sequence's row). The table's row stride is the step's
widest table (eager steps), or a fixed width for a captured decode graph. "fill" lists tokens
whose id is still on the device (sampled by the step in flight, see the scheduler's NOTE):
``input_ids[fill_dst[i]] = previous_sampled[fill_src[i]]`` runs on the device before the
forward pass.

Two host sets alternate, so writing step N+1 never races the copy of step N still in flight;
a copy moves only the used prefix of each buffer.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from common.attention import AttentionMetadata
from common.block_table import BlockTableRows
from common.step_outputs import ScheduledRequest


@dataclass(frozen=True)
class BatchLimits:
    """The largest step the buffers hold."""

    max_tokens: int  # tokens per step (max_num_batched_tokens, or more for padded graphs)
    max_seqs: int  # sequences per step
    max_blocks_per_seq: int  # block table width for max_model_len


class StepShape(NamedTuple):
    """The sizes of one prepared step: what a tensor-parallel worker needs, with the host
    buffers, to take the step over (``InputBuffers.adopt``)."""

    num_tokens: int
    num_seqs: int
    row_stride: int  # block-table width
    num_logits_rows: int
    max_query_len: int
    max_seq_len: int
    num_table_changes: int  # (flat index, id) pairs staged for the device rows


class StepInputs(NamedTuple):
    """Device views of one step's inputs (valid until the next ``prepare``)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # (R,) int64: hidden rows to sample (k + 1 with k drafts)
    num_logits_rows: int
    num_fill: int  # tokens to take from the previous step's sampled ids
    num_table_changes: int = 0  # block-table entries this step changed

    @property
    def shape(self) -> StepShape:
        m = self.meta
        num_seqs, stride = m.block_tables.shape
        return StepShape(
            self.input_ids.shape[0],
            num_seqs,
            stride,
            self.num_logits_rows,
            m.max_query_len,
            m.max_seq_len,
            self.num_table_changes,
        )


class _Views(NamedTuple):
    """The device views of one step shape (fixed addresses)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    logits_rows: torch.Tensor


_VIEW_CACHE_SIZE = 256  # step shapes whose views are kept (cleared when full)


class _Offsets(NamedTuple):
    tokens: int
    positions: int
    slots: int
    logits_rows: int
    fill: int
    int64_size: int
    seq_lens: int
    table_rows: int
    table_changes: int
    block_tables: int
    int32_size: int


def _offsets(lim: BatchLimits) -> _Offsets:
    t, s, w = lim.max_tokens, lim.max_seqs, lim.max_blocks_per_seq
    return _Offsets(
        tokens=0,
        positions=t,
        slots=2 * t,
        logits_rows=3 * t,
        fill=4 * t,
        int64_size=6 * t,
        seq_lens=s + 1,
        table_rows=2 * s + 1,
        table_changes=3 * s + 1,
        block_tables=3 * s + 1 + 2 * s * w,
        int32_size=3 * s + 1 + 3 * s * w,
    )


class InputBuffers:
    """Persistent input buffers and block-table rows of one model runner. Not thread-safe (the
    engine thread owns it).

    ``prepare`` takes the scheduler's plan and the previous step's sampled rows and returns
    device views; ``padded_seqs`` pads a pure-decode batch to a captured graph's size (padding
    rows: token 0 at position 0, slot -1, seq len 0, the zero table row; output ignored).
    A tensor-parallel worker receives rank 0's host buffers instead (``next_host``, ``adopt``).
    """

    def __init__(self, limits: BatchLimits, block_size: int, device: torch.device) -> None:
        self.limits, self.block_size, self.device = limits, block_size, device
        self.off = o = _offsets(limits)
        on_cuda = device.type == "cuda"
        host32_size = o.block_tables if on_cuda else o.int32_size  # tables: device only
        self._host = [
            (
                torch.zeros(o.int64_size, dtype=torch.int64, pin_memory=on_cuda),
                torch.zeros(host32_size, dtype=torch.int32, pin_memory=on_cuda),
            )
            for _ in range(2 if on_cuda else 1)
        ]
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._turn = itertools.cycle(range(len(self._host)))
        self._k = 0  # the host set in use
        self._host_np = [(h64.numpy(), h32.numpy()) for h64, h32 in self._host]
        self._view_cache: dict[tuple[int, ...], _Views] = {}
        self.last_host = self._host[0]  # the host set of the latest step (TP broadcasts it)
        if on_cuda:
            self.int64 = torch.zeros(o.int64_size, dtype=torch.int64, device=device)
            self.int32 = torch.zeros(o.int32_size, dtype=torch.int32, device=device)
        else:
            self.int64, self.int32 = self._host[0]
        num_rows, width = 2 * limits.max_seqs, limits.max_blocks_per_seq
        self.table = BlockTableRows(num_rows, width)  # rank 0's host rows
        self.rows = (_DeviceRows if on_cuda else _HostRows)(num_rows + 1, width, self.int32, o)

    # -- fixed device views (what a captured graph reads) ---------------------------------------
    def views(
        self, num_tokens: int, num_seqs: int, row_stride: int, num_logits_rows: int = 0
    ) -> StepInputs:
        v = self._views(num_tokens, num_seqs, row_stride, num_logits_rows)
        meta = AttentionMetadata(
            query_start_loc=v.query_start_loc,
            seq_lens=v.seq_lens,
            block_tables=v.block_tables,
            slot_mapping=v.slot_mapping,
            query_lens=[],
            seq_lens_cpu=[],
            max_query_len=1,
            max_seq_len=row_stride * self.block_size,
        )
        return StepInputs(v.input_ids, v.positions, meta, v.logits_rows, num_logits_rows, 0)

    def _views(
        self, num_tokens: int, num_seqs: int, row_stride: int, num_logits_rows: int
    ) -> _Views:
        """The tensor views of one step's shape, made once (slicing costs ~5 us a view)."""
        key = (num_tokens, num_seqs, row_stride, num_logits_rows, torch.is_inference_mode_enabled())
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= _VIEW_CACHE_SIZE:
                self._view_cache.clear()
            o = self.off
            views = self._view_cache[key] = _Views(
                self.int64[o.tokens : o.tokens + num_tokens],
                self.int64[o.positions : o.positions + num_tokens],
                self.int32[: num_seqs + 1],
                self.int32[o.seq_lens : o.seq_lens + num_seqs],
                self._tables(num_seqs, row_stride),
                self.int64[o.slots : o.slots + num_tokens],
                self.int64[o.logits_rows : o.logits_rows + num_logits_rows],
            )
        return views

    def _tables(self, num_seqs: int, row_stride: int) -> torch.Tensor:
        o = self.off
        flat = self.int32[o.block_tables : o.block_tables + num_seqs * row_stride]
        return flat.view(num_seqs, row_stride)

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
    def next_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host set the next step is written (or, on a TP worker, received) into, once the
        device copy that last read it is done; it becomes ``last_host``."""
        k = next(self._turn)
        event = self._copied[k]
        if event is not None:
            event.synchronize()  # the copy of two steps ago; long done in practice
        self._k = k
        self.last_host = self._host[k]
        return self.last_host

    def prepare(
        self,
        scheduled: list[ScheduledRequest],
        prev_rows: dict[str, int],
        *,
        padded_seqs: int | None = None,
        row_stride: int | None = None,
    ) -> StepInputs:
        """Write the step's inputs and start their copy to the device; bring the block-table
        rows up to date (host and device).

        ``prev_rows``: request id → its row in the previous step's sampled ids, for requests
        whose newest token is still on the device. ``padded_seqs``/``row_stride``: the shape of
        a captured decode graph (pure decode steps only).
        """
        host64, host32 = self.next_host()
        h64, h32 = self._host_np[self._k]
        o = self.off
        batch = _HostBatch.build(scheduled, prev_rows)
        num_seqs = padded_seqs or len(scheduled)
        # a graph's step has one attention row per token (a draft's row sees the cache up to
        # its own position), so its padding rows are tokens too
        num_tokens = num_seqs if padded_seqs else batch.num_tokens
        self._check_fits(num_tokens, num_seqs, row_stride or 0)
        changes = self.table.update(scheduled, h32[o.table_changes : o.block_tables])
        try:
            stride = row_stride or changes.widest
            if stride < changes.widest:
                raise ValueError(f"a table of {changes.widest} blocks in rows of {stride}")
            rows = changes.rows
            if padded_seqs and batch.num_tokens > len(scheduled):
                batch, rows = batch.per_token(rows)
            batch.write(h64, h32, o, num_seqs, rows, self.table, self.block_size)
            used64 = o.fill + 2 * len(batch.fill_dst)
            self._to_device(host64, host32, used64, o.table_changes + 2 * changes.num_changes)
            self.rows.apply(changes.num_changes)
        except BaseException:
            self.table.forget(changes.rows)
            raise
        self.rows.gather(num_seqs, stride)
        views = self.views(num_tokens, num_seqs, stride, len(batch.logits_rows))
        pad = num_seqs - len(batch.query_lens)
        meta = views.meta
        meta.query_lens = batch.query_lens + [1] * pad if pad else batch.query_lens
        meta.seq_lens_cpu = batch.seq_lens + [0] * pad if pad else batch.seq_lens
        meta.max_query_len = (
            1 if batch.num_tokens == len(batch.query_lens) else max(batch.query_lens)
        )
        meta.max_seq_len = row_stride * self.block_size if row_stride else max(batch.seq_lens)
        return views._replace(num_fill=len(batch.fill_dst), num_table_changes=changes.num_changes)

    def adopt(self, shape: StepShape) -> StepInputs:
        """A tensor-parallel worker's step: ``last_host`` (from ``next_host``) already holds the
        used prefixes of the host buffers rank 0 prepared (eager, nothing to fill); start their
        copy, apply the table changes to this rank's rows and return the views."""
        host64, host32 = self.last_host
        o = self.off
        self._to_device(host64, host32, *self.used_prefixes(shape))
        self.rows.apply(shape.num_table_changes)
        self.rows.gather(shape.num_seqs, shape.row_stride)
        views = self.views(
            shape.num_tokens, shape.num_seqs, shape.row_stride, shape.num_logits_rows
        )
        h32 = host32.numpy()
        meta = views.meta
        meta.query_lens = np.diff(h32[: shape.num_seqs + 1]).tolist()
        meta.seq_lens_cpu = h32[o.seq_lens : o.seq_lens + shape.num_seqs].tolist()
        meta.max_query_len, meta.max_seq_len = shape.max_query_len, shape.max_seq_len
        return views

    def used_prefixes(self, shape: StepShape) -> tuple[int, int]:
        """The int64 and int32 elements a tensor-parallel worker needs of a step's host
        buffers (all but the fill lists: rank 0 sends the filled ids on the device)."""
        o = self.off
        return o.logits_rows + shape.num_logits_rows, o.table_changes + 2 * shape.num_table_changes

    def fill_from(self, inputs: StepInputs, previous: torch.Tensor) -> None:
        """Put the ids still on the device (``previous``: last step's sampled ids) in place."""
        if not inputs.num_fill:
            return
        o, n = self.off, inputs.num_fill
        dst = self.int64[o.fill : o.fill + n]
        src = self.int64[o.fill + n : o.fill + 2 * n]
        inputs.input_ids.index_copy_(0, dst, previous.index_select(0, src))

    # -- host to device -------------------------------------------------------------------------
    def _to_device(
        self, host64: torch.Tensor, host32: torch.Tensor, used64: int, used32: int
    ) -> None:
        """Start the copy of the used prefixes (CUDA; on CPU the host buffers are the device's)."""
        if self.device.type != "cuda":
            return
        self.int64[:used64].copy_(host64[:used64], non_blocking=True)
        self.int32[:used32].copy_(host32[:used32], non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(self.device))  # this device's, by name
        self._copied[self._k] = copied

    def _check_fits(self, num_tokens: int, num_seqs: int, row_stride: int) -> None:
        lim = self.limits
        if (
            num_tokens > lim.max_tokens
            or num_seqs > lim.max_seqs
            or row_stride > lim.max_blocks_per_seq
        ):
            raise ValueError(
                f"step of {num_tokens} tokens, {num_seqs} sequences, rows of {row_stride} blocks"
                f" exceeds {lim}"
            )


class _DeviceRows:
    """This device's block-table rows ``(num_rows, width)`` int32 (CUDA), changed and gathered
    from the int32 buffer's regions (``_Offsets``), each in one kernel."""

    def __init__(self, num_rows: int, width: int, int32: torch.Tensor, off: _Offsets) -> None:
        self.rows = torch.zeros((num_rows, width), dtype=torch.int32, device=int32.device)
        self.int32, self.off = int32, off

    def apply(self, num_changes: int) -> None:
        """Write the ``num_changes`` staged ``(flat index, id)`` pairs into the rows."""
        o = self.off
        pairs = self.int32[o.table_changes : o.table_changes + 2 * num_changes].view(-1, 2)
        self.rows.view(-1).index_put_((pairs[:, 0],), pairs[:, 1])

    def gather(self, num_seqs: int, row_stride: int) -> None:
        """``block tables[i] = rows[table rows[i], :row_stride]`` for the step's sequences."""
        o = self.off
        index = self.int32[o.table_rows : o.table_rows + num_seqs]
        out = self.int32[o.block_tables : o.block_tables + num_seqs * row_stride]
        torch.index_select(self.rows[:, :row_stride], 0, index, out=out.view(num_seqs, -1))


class _HostRows:
    """The rows of an engine whose device is the host: the same operations in numpy (torch's
    CPU ``index_select`` over a column slice costs ~9 ms at 256 x 260, numpy ~0.05)."""

    def __init__(self, num_rows: int, width: int, int32: torch.Tensor, off: _Offsets) -> None:
        self.rows = np.zeros((num_rows, width), dtype=np.int32)
        self.int32, self.off = int32.numpy(), off

    def apply(self, num_changes: int) -> None:
        o = self.off
        pairs = self.int32[o.table_changes : o.table_changes + 2 * num_changes]
        self.rows.reshape(-1)[pairs[0::2]] = pairs[1::2]

    def gather(self, num_seqs: int, row_stride: int) -> None:
        o = self.off
        index = self.int32[o.table_rows : o.table_rows + num_seqs]
        out = self.int32[o.block_tables : o.block_tables + num_seqs * row_stride]
        out.reshape(num_seqs, row_stride)[:] = self.rows[index, :row_stride]


_start = operator.attrgetter("num_computed_tokens")
_num_new = operator.attrgetter("num_new_tokens")
_samples = operator.attrgetter("samples")
_request = operator.attrgetter("request")
_request_id = operator.attrgetter("request_id")
_all_token_ids = operator.attrgetter("all_token_ids")


@dataclass
class _HostBatch:
    """The step as host lists, before they are written into the buffers."""

    tokens: list[int]  # 0 where the id is still on the device
    starts: list[int]  # tokens already in the cache, per sequence
    query_lens: list[int]
    seq_lens: list[int]
    logits_rows: list[int]
    fill_dst: list[int]
    fill_src: list[int]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @staticmethod
    def build(scheduled: list[ScheduledRequest], prev_rows: dict[str, int]) -> _HostBatch:
        starts = list(map(_start, scheduled))
        q_lens = list(map(_num_new, scheduled))
        if q_lens.count(1) == len(q_lens):  # a decode step (drafts make two rows or more)
            return _HostBatch._decode(scheduled, starts, q_lens, prev_rows)
        return _HostBatch._mixed(scheduled, starts, q_lens, prev_rows)

    @staticmethod
    def _decode(
        scheduled: list[ScheduledRequest],
        starts: list[int],
        q_lens: list[int],
        prev_rows: dict[str, int],
    ) -> _HostBatch:
        """One token per sequence, built at C speed (``map``): a step of 256 costs ~0.05 ms."""
        requests = list(map(_request, scheduled))
        token_ids = list(map(_all_token_ids, requests))
        # the token at a row's position is known, or it is the one the step in flight samples
        in_flight = list(map(operator.ge, starts, map(len, token_ids)))
        fill_dst: list[int] = []
        fill_src: list[int] = []
        if not any(in_flight):
            tokens = list(map(operator.getitem, token_ids, starts))
        elif all(in_flight):  # the overlapped loop's steady state
            tokens = [0] * len(scheduled)
            fill_dst = list(range(len(scheduled)))
            fill_src = list(map(prev_rows.__getitem__, map(_request_id, requests)))
        else:
            tokens = []
            for i, (ids, a, flying) in enumerate(zip(token_ids, starts, in_flight)):
                tokens.append(0 if flying else ids[a])
                if flying:
                    fill_dst.append(i)
                    fill_src.append(prev_rows[requests[i].request_id])
        logits_rows = list(itertools.compress(range(len(scheduled)), map(_samples, scheduled)))
        seq_lens = list(map((1).__add__, starts))
        return _HostBatch(tokens, starts, q_lens, seq_lens, logits_rows, fill_dst, fill_src)

    @staticmethod
    def _mixed(
        scheduled: list[ScheduledRequest],
        starts: list[int],
        q_lens: list[int],
        prev_rows: dict[str, int],
    ) -> _HostBatch:
        """Any step (prompt chunks, drafts to verify, decodes), row by row."""
        tokens: list[int] = []
        logits_rows: list[int] = []
        fill_dst: list[int] = []
        fill_src: list[int] = []
        for s, a, q in zip(scheduled, starts, q_lens):
            r, b = s.request, a + q
            ids = r.all_token_ids
            known = min(b, len(ids))
            tokens += ids[a:known]
            if s.spec_token_ids:  # drafts to verify follow the request's newest token
                tokens += s.spec_token_ids
            elif known < b:  # exactly one: the token the previous step sampled for it
                assert b - known == 1, (r.request_id, a, b, len(ids))
                fill_dst.append(len(tokens))
                fill_src.append(prev_rows[r.request_id])
                tokens.append(0)
            if s.samples:  # the last row, or every verified position
                end = len(tokens)
                logits_rows += range(end - 1 - len(s.spec_token_ids), end)
        seq_lens = list(map(operator.add, starts, q_lens))
        return _HostBatch(tokens, starts, q_lens, seq_lens, logits_rows, fill_dst, fill_src)

    def _positions(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``query_start_loc``, each token's position and each token's table row."""
        n, s = self.num_tokens, len(self.query_lens)
        starts = np.asarray(self.starts, np.int64)
        if n == s:  # one token per sequence (decode): no repeats
            return np.arange(s + 1, dtype=np.int64), starts, rows
        q_lens = np.asarray(self.query_lens, np.int64)
        qsl = np.concatenate(([0], q_lens.cumsum()))
        positions = np.arange(n, dtype=np.int64) - np.repeat(qsl[:-1] - starts, q_lens)
        return qsl, positions, np.repeat(rows, q_lens)

    def per_token(self, rows: np.ndarray) -> tuple[_HostBatch, np.ndarray]:
        """The same step with every token its own attention row (what a decode graph runs):
        a verified draft's row reads the cache up to its own position, the drafts before it
        included (each layer writes the step's K/V before it attends), which is the causal
        mask of the sequence's k + 1 tokens. Returns the batch and each row's table row."""
        _, positions, token_rows = self._positions(rows)
        starts = positions.tolist()
        n = self.num_tokens
        return (
            _HostBatch(
                self.tokens,
                starts,
                [1] * n,
                list(map((1).__add__, starts)),
                self.logits_rows,
                self.fill_dst,
                self.fill_src,
            ),
            token_rows,
        )

    def write(
        self,
        h64: np.ndarray,
        h32: np.ndarray,
        o: _Offsets,
        num_seqs: int,
        rows: np.ndarray,
        table: BlockTableRows,
        block_size: int,
    ) -> None:
        """Fill the host buffers (padding rows included); slots come from the host rows
        (``rows``: each sequence's)."""
        n, s = self.num_tokens, len(self.query_lens)
        qsl, positions, token_rows = self._positions(rows)
        pad = num_seqs - s  # padding rows of a captured graph: harmless inputs, output ignored
        h64[o.tokens : o.tokens + n] = self.tokens
        h64[o.positions : o.positions + n] = positions
        blocks = table.host[token_rows, positions // block_size].astype(np.int64)
        h64[o.slots : o.slots + n] = blocks * block_size + positions % block_size
        if pad:
            h64[o.tokens + n : o.tokens + n + pad] = 0
            h64[o.positions + n : o.positions + n + pad] = 0
            h64[o.slots + n : o.slots + n + pad] = -1
        r, f = len(self.logits_rows), len(self.fill_dst)
        h64[o.logits_rows : o.logits_rows + r] = self.logits_rows
        h64[o.fill : o.fill + f] = self.fill_dst
        h64[o.fill + f : o.fill + 2 * f] = self.fill_src
        h32[: s + 1] = qsl
        h32[s + 1 : num_seqs + 1] = np.arange(n + 1, n + 1 + pad, dtype=np.int32)
        h32[o.seq_lens : o.seq_lens + s] = self.seq_lens
        h32[o.seq_lens + s : o.seq_lens + num_seqs] = 0
        h32[o.table_rows : o.table_rows + s] = rows
        h32[o.table_rows + s : o.table_rows + num_seqs] = table.pad_row
