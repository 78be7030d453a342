"""Block tables kept across steps: one row per request on the host and on the device, so that
a step copies only the block ids that changed, never the tables.

NOTE: what a row follows. The KV cache manager owns each request's block ids and gives them a
new *version* whenever they change other than by growing at the end: made (first allocation,
again after a preemption, roll-back or remote load), trimmed (rejected drafts), freed and made
again. A row remembers the version and how many ids it holds. Same version: only the ids past
that count are new. Another version, or none (a plan built by hand): the row is written whole.
Rows belong to requests by id; when none is free, the row least recently in a step goes to the
newcomer (there are more rows than sequences in a step), and its owner is written whole if it
comes back.

```
host rows    (R + 1, W) int32   the truth on the host (the step's slot mapping reads it)
device rows  (R + 1, W) int32   follows the host from the step's changes: (flat index, id) pairs
step table   (S, stride) int32  the step's rows gathered on the device: what the kernels read
                                 R rows (2 per sequence of a step), W = blocks of max_model_len;
                                 row R stays zero: the row of a graph's padding sequences
```

On a CPU the host rows are the device rows. Plain numpy here; ``InputBuffers`` moves the
changes and gathers the step's table (``common/step_inputs.py``).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from common.step_outputs import ScheduledRequest

_request_id = operator.attrgetter("request.request_id")
_block_ids = operator.attrgetter("block_ids")
_table_version = operator.attrgetter("block_table_version")
# the version of a row whose ids match no plan: unequal to every version and to None (a plan
# without a version), so the row is written whole
_UNVERSIONED = object()
_NOTHING = (_UNVERSIONED, 0)


class TableChanges(NamedTuple):
    """What one step did to the rows."""

    rows: np.ndarray  # (S,) int64: each scheduled request's row, in step order
    num_changes: int  # (flat index, id) pairs written to the staging array
    widest: int  # blocks in the step's longest table


class BlockTableRows:
    """Per-request rows of block ids, kept across steps (host side). Not thread-safe: the
    engine thread owns it.

    ``host`` is ``(num_rows + 1, width)`` int32; ``pad_row`` (the last) is never written."""

    def __init__(self, num_rows: int, width: int, host: np.ndarray | None = None) -> None:
        """``host``: the ``(num_rows + 1, width)`` int32 array to keep the rows in (the device
        rows themselves on a CPU), else a new one."""
        self.width, self.pad_row = width, num_rows
        self.host = np.zeros((num_rows + 1, width), np.int32) if host is None else host
        assert self.host.shape == (num_rows + 1, width) and self.host.dtype == np.int32
        self._flat = self.host.reshape(-1)  # a view: the flat index of (row, col) is row*W+col
        self._row_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * num_rows
        # (version, count) of the owner's ids the row holds
        self._held: list[tuple[object, int]] = [_NOTHING] * num_rows
        self._last_step = np.full(num_rows, -1, np.int64)
        self._free = list(range(num_rows - 1, -1, -1))  # lowest row first
        self._step = 0

    def row_of(self, request_id: str) -> int | None:
        return self._row_of.get(request_id)

    def update(self, scheduled: list[ScheduledRequest], staging: np.ndarray) -> TableChanges:
        """Bring every scheduled request's row up to its ``block_ids``; write each entry that
        changed into ``host`` and, as ``(flat index, id)`` pairs, into ``staging`` (int32, room
        for ``2 * len(scheduled) * width``). Raises, changing no row's ids, when a table is
        wider than the rows."""
        self._step += 1
        rows = self._rows_for(list(map(_request_id, scheduled)))
        tables = list(map(_block_ids, scheduled))
        lens = list(map(len, tables))
        widest = max(lens, default=0)
        if widest > self.width:
            raise ValueError(f"a table of {widest} blocks; rows hold {self.width}")
        # (version, length) now and as the row holds it: equal for the common row, which is
        # compared at C speed and never visited
        now = list(zip(map(_table_version, scheduled), lens))
        held = list(map(self._held.__getitem__, rows))
        stale = itertools.compress(range(len(rows)), map(operator.ne, now, held))
        seg_starts: list[int] = []  # flat index of each changed run's first entry
        seg_lens: list[int] = []
        values: list[int] = []
        for i in stale:
            (version, n), (held_version, held_n) = now[i], held[i]
            start = held_n if version == held_version else 0
            assert n >= start, (scheduled[i].request.request_id, n, start)  # a version grows
            seg_starts.append(rows[i] * self.width + start)
            seg_lens.append(n - start)
            values += tables[i][start:] if start else tables[i]
            self._held[rows[i]] = (_UNVERSIONED if version is None else version, n)
        rows_np = np.asarray(rows, np.int64)
        self._last_step[rows_np] = self._step
        num_changes = self._write(seg_starts, seg_lens, values, staging)
        return TableChanges(rows_np, num_changes, widest)

    def _rows_for(self, request_ids: list[str]) -> list[int]:
        """Each request's row; a request without one takes one (see ``_take_row``)."""
        rows = list(map(self._row_of.get, request_ids))
        if None not in rows:
            return rows  # type: ignore[return-value]
        if not self._free:  # rows of this step are not to be taken
            self._last_step[[row for row in rows if row is not None]] = self._step
        for i, row in enumerate(rows):
            if row is None:
                rows[i] = self._take_row(request_ids[i])
        return rows  # type: ignore[return-value]

    def forget(self, rows: Iterable[int]) -> None:
        """Have ``rows`` written whole the next time (a step that failed after ``update``: its
        changes may never have reached the device)."""
        for row in rows:
            self._held[row] = _NOTHING

    def _write(
        self, seg_starts: list[int], seg_lens: list[int], values: list[int], staging: np.ndarray
    ) -> int:
        total = len(values)
        if not total:
            return 0
        lens = np.asarray(seg_lens, np.int64)
        ends = np.cumsum(lens)
        firsts = np.asarray(seg_starts, np.int64) - (ends - lens)  # flat index minus position
        flat = np.arange(total, dtype=np.int64) + np.repeat(firsts, lens)
        ids = np.asarray(values, np.int32)
        self._flat[flat] = ids
        staging[0 : 2 * total : 2] = flat
        staging[1 : 2 * total : 2] = ids
        return total

    def _take_row(self, request_id: str) -> int:
        """A free row, else the one least recently in a step (rows of this step are marked)."""
        if self._free:
            row = self._free.pop()
        else:
            row = int(np.argmin(self._last_step))
            assert self._last_step[row] < self._step, "more sequences in a step than rows"
            del self._row_of[self._owner[row]]  # type: ignore[arg-type]
        self._owner[row], self._row_of[request_id] = request_id, row
        self._held[row] = _NOTHING
        self._last_step[row] = self._step
        return row

    def check_integrity(self) -> None:
        """Owners and rows map one to one; the padding row is zero."""
        assert all(self._owner[row] == rid for rid, row in self._row_of.items())
        assert len(self._row_of) + len(self._free) == len(self._owner)
        assert not self.host[self.pad_row].any()
