"""The I/O worker pool of a store, and scatter/gather I/O over chunked payloads.

`BatchPool` splits a batch of `n` items into contiguous slices, one per thread; the calling
thread runs the first slice and the pool's threads the rest. That only pays where the work of an
item releases the GIL for most of its time:

- os.preadv / os.pwritev (`preadv_all`, `pwritev_all`) release it for the syscall: the
  `FileStore` reads and writes entry files this way;
- numpy copies (np.copyto) release it for the memcpy: the `ArenaStore` copies in and out of its
  mapping this way;
- xxh3 (the entry checksum) and per-item Python work hold it (~10% of an entry's write time on
  tmpfs): they do not overlap, whatever the thread count.

NOTE (when a batch is split over threads): every syscall or copy of a worker drops and retakes
the GIL, and every slice costs a hand-off to a thread (~30-50 µs). `BatchPool.map` therefore runs
a batch inline unless its items average at least `min_item_bytes` and it has at least
`min_slice_bytes` for each of two or more slices; it then uses min(workers, items,
bytes // min_slice_bytes) slices. The defaults are measured for syscalls (preadv/pwritev on
tmpfs, 2 cores): with 32 KiB entries the GIL churn costs more than the overlap gains (1 worker
0.52/1.16 GB/s put/get, 2 workers 0.40/0.72); at 512 KiB threads win (1.70/3.35 vs 2.78/5.34).
Hence 128 KiB per item and 1 MiB per slice. A store whose items cost otherwise passes its own:
the `ArenaStore`'s copies release the GIL but its per-entry Python work and xxh3 do not, and
threads pay there from ~256 KiB per entry (it passes 256 KiB and 2 MiB).

Buffers are `memoryview`s of bytes (`entry.chunk_views`); the caller owns them and must keep them alive
and unchanged until the call that uses them returns. `BatchPool.map` returns only once every
slice has finished, even when one raised, so no worker touches a batch after its call.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

from kv_store.base import Payload

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
MIN_PARALLEL_ITEM = 128 << 10  # below this per item, the GIL churn of a worker outweighs it
MIN_SLICE_BYTES = 1 << 20  # a slice must outweigh its hand-off to a thread (~30-50 µs)

T = TypeVar("T")


def default_workers() -> int:
    """Worker threads per store: min(8, cpu count); tmpfs stops scaling beyond ~8 writers."""
    return min(8, os.cpu_count() or 1)


class BatchPool:
    """Threads owned by one store that split a batch into contiguous slices.

    `map(fn, n, nbytes)` returns `[fn(0), …, fn(n - 1)]` in order, for a batch of `n` items
    moving `nbytes` in all. The calling thread runs the first slice itself. A batch runs inline
    when its items average less than `min_item_bytes` or it has too few bytes to give every
    slice `min_slice_bytes`. Threads start on first use; `close()` joins them.
    """

    def __init__(
        self,
        workers: int,
        *,
        min_item_bytes: int = MIN_PARALLEL_ITEM,
        min_slice_bytes: int = MIN_SLICE_BYTES,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers = workers
        self.min_item_bytes = min_item_bytes
        self.min_slice_bytes = min_slice_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def map(self, fn: Callable[[int], T], n: int, nbytes: int) -> list[T]:
        slices = min(self.workers, n, nbytes // max(1, self.min_slice_bytes))
        if slices <= 1 or nbytes < n * self.min_item_bytes:
            return [fn(i) for i in range(n)]
        bounds = [n * s // slices for s in range(slices + 1)]

        def run(lo: int, hi: int) -> list[T]:
            return [fn(i) for i in range(lo, hi)]

        executor = self._get_executor()
        futures: list[Future[list[T]]] = [
            executor.submit(run, lo, hi) for lo, hi in itertools.pairwise(bounds[1:])
        ]
        try:
            out = run(bounds[0], bounds[1])
        finally:
            wait(futures)  # never return (or raise) while a slice still touches the batch
        for future in futures:
            out += future.result()
        return out

    def _get_executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.workers - 1, "kv-store-io")
            return self._executor

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


def as_payload(chunks: list[memoryview]) -> Payload:
    """A one-chunk payload as its buffer, so `entry` takes its fast path."""
    return chunks[0] if len(chunks) == 1 else chunks


def pwritev_all(fd: int, chunks: Sequence[memoryview], offset: int) -> None:
    """Write every chunk, in order, from `offset`: one pwritev per IOV_MAX chunks, resumed after
    a short write. Raises OSError if the file stops growing (e.g. ENOSPC)."""
    pending = list(chunks)
    if len(pending) <= IOV_MAX:  # the common case: one call writes everything
        n = os.pwritev(fd, pending, offset)
        if n == sum(len(c) for c in pending):
            return
        offset += max(n, 0)
        pending = _advance(pending, max(n, 0))
    while pending:
        group = pending[:IOV_MAX]
        n = os.pwritev(fd, group, offset)
        if n <= 0:
            raise OSError("short write")
        offset += n
        pending = _advance(group, n) + pending[IOV_MAX:]


def preadv_all(fd: int, bufs: Sequence[memoryview | bytearray], offset: int) -> int:
    """Fill `bufs` in order from `offset` until they are full or the file ends; bytes read.
    For regular files, which read short only at their end: one preadv per IOV_MAX buffers."""
    if len(bufs) <= IOV_MAX:
        return os.preadv(fd, bufs, offset)
    total = 0
    for first in range(0, len(bufs), IOV_MAX):
        group = bufs[first : first + IOV_MAX]
        n = os.preadv(fd, group, offset + total)
        total += n
        if n < sum(len(b) for b in group):
            break
    return total


def _advance(group: list[memoryview], n: int) -> list[memoryview]:
    """The part of `group` left after its first `n` bytes were transferred."""
    for i, buf in enumerate(group):
        if n < len(buf):
            return [buf[n:], *group[i + 1 :]]
        n -= len(buf)
    return []
