"""Loaders: blocks named by a step's load specs, from the store into the paged cache.

A background reader fetches the entries while the engine keeps stepping other requests (the
request waits in ``WAITING_FOR_REMOTE_KV``); ``finished`` reports each request whose load is in,
and every block that did not arrive intact (missing, evicted, corrupt, unreachable) is a failed
block (``take_failed``), which the scheduler recomputes: output never changes, only speed.

One class per placement, chosen when the worker is built:

```
InPlaceLoader   CPU          reader: get entries straight into their blocks of the paged cache
StagedLoader    CPU twin     reader: into a staging slot → a request's earlier parts land at once,
 └ StreamLoader CUDA           its last part in the next forward pass, layer by layer (CUDA: H2D
                               + scatter on the load stream, each layer's attention waits for
                               its own event only)
ExchangeLoader  TP rank 0    reader: into a staging slot → every part lands between steps into
                             every rank's heads (common/parallel/block_exchange.py)
```

(``staged_loader.py`` holds the staged three.) A request that ends (abort, disconnect) while its
load is in flight is cancelled: nothing of it is written into its blocks afterwards, which the
scheduler may hand to another request at once.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from common.kv_interface import KVCacheSpec, LoadSpec
from kv_store.base import KVStore
from kv_transfer.staging import RingClosed

logger = logging.getLogger(__name__)


class Fetched(NamedTuple):
    """One fetched part of a load: ``ok[i]`` says whether entry ``i`` (into block
    ``block_ids[i]``) arrived intact; ``last``: the request's last part. ``slot`` and ``staged``
    (its layer-major view) hold the bytes when they came through staging, else None (read in
    place, or nothing read)."""

    request_id: str
    block_ids: list[int]
    ok: list[bool]
    last: bool
    slot: torch.Tensor | None = None
    staged: torch.Tensor | None = None


class Loader(ABC):
    """The reader thread, cancellation and the accounting every placement shares; the hooks a
    placement overrides do nothing here. Threads: the engine thread (these methods) and one
    reader that drives the store (which spreads a batch over its own I/O workers)."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, per_slot: int):
        self.store, self.spec, self.device, self.per_slot = store, spec, device, per_slot
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-reader")
        self._to_fetch: queue.SimpleQueue[LoadSpec] = queue.SimpleQueue()
        self._fetched: queue.SimpleQueue[Fetched] = queue.SimpleQueue()
        self._loading: set[str] = set()  # requests with parts still to arrive
        self._cancelled: set[str] = set()  # ended while loading: their parts are dropped
        self._failed: set[int] = set()
        self._kv_cache: torch.Tensor | None = None
        self.num_loaded_blocks = self.num_failed_blocks = 0
        self.wake: Callable[[], None] = lambda: None  # a part arrived (the engine may wait)

    def _arrive(self, item: Fetched) -> None:
        """Reader thread: a fetched part, handed to the engine thread."""
        self._fetched.put(item)
        self.wake()

    def start(self, loads: list[LoadSpec], kv_cache: torch.Tensor) -> None:
        """Start this step's fetches in the background (the requests stay parked meanwhile)."""
        self._kv_cache = kv_cache
        for spec in loads:
            self._loading.add(spec.request_id)
            self._to_fetch.put(spec)
        if loads:
            self._reader.submit(self._fetch_queued)

    def _fetch_queued(self) -> None:
        """Reader thread: every load queued so far (earlier submissions may have taken them
        all), onto the fetched queue. Never raises: whatever did not arrive is a failed block."""
        specs = []
        while True:
            try:
                specs.append(self._to_fetch.get_nowait())
            except queue.Empty:
                break
        try:
            self._read(specs)
        except RingClosed:  # closing: nobody waits for these loads any more
            return
        except Exception:  # a bug here must cost a recompute, never a request parked forever
            logger.exception("KV reader failed; %d loads fall back to recompute", len(specs))
            for spec in specs:  # every block failed: the scheduler recomputes the prompt
                failed = [False] * len(spec.block_ids)
                self._arrive(Fetched(spec.request_id, spec.block_ids, failed, True))

    @abstractmethod
    def _read(self, specs: list[LoadSpec]) -> None:
        """Reader thread: fetch ``specs``, each part onto the fetched queue as it arrives."""

    def wait_for_layer(self, layer: int) -> None:
        """Layer ``layer`` of what has arrived is in the paged cache (nothing to do here)."""
        return None

    def layer_work_pending(self) -> bool:
        return False

    def finished(self, ended: set[str]) -> set[str]:
        """Requests whose loads are in since the last call. ``ended``: requests the scheduler
        ended since then; their loads are dropped, never written into blocks that may already
        be reused."""
        if ended:
            self._cancel(ended)
        self._drop_ended(ended)
        return self._drain_fetched()

    def _cancel(self, ended: set[str]) -> None:
        self._cancelled.update(ended & self._loading)

    def _drop_ended(self, ended: set[str]) -> None:
        """What this placement still holds of the ended requests' loads goes."""
        return None

    def _drain_fetched(self) -> set[str]:
        done: set[str] = set()
        while True:
            try:
                item = self._fetched.get_nowait()
            except queue.Empty:
                return done
            if item.last:
                self._loading.discard(item.request_id)
            if item.request_id in self._cancelled:
                self._discard(item)
                if item.last:
                    self._cancelled.discard(item.request_id)
                continue
            good = sum(item.ok)
            self._failed.update(b for b, hit in zip(item.block_ids, item.ok) if not hit)
            self.num_loaded_blocks += good
            self.num_failed_blocks += len(item.ok) - good
            if self._arrived(item):
                done.add(item.request_id)

    def _arrived(self, item: Fetched) -> bool:
        """A part of a live request is in: whether its request's load is done (read in place:
        the bytes are in the cache already, so with its last part)."""
        return item.last

    def _discard(self, item: Fetched) -> None:
        """A fetched part of a cancelled request."""
        return None

    def take_failed(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        """Stop the reader; loads in flight are dropped."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        while not self._fetched.empty():
            self._fetched.get_nowait()
        self._kv_cache = None


class InPlaceLoader(Loader):
    """CPU: the reader reads entries straight into their blocks of the paged cache, the loads of
    several requests batched into one store call (fewer, fuller batches for the store's
    workers), under the load lock: a request ended meanwhile is cancelled under that lock
    (``finished``, before the next ``schedule`` can hand its blocks to anyone else), so no read
    ever writes into a block that is no longer its request's."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, per_slot: int):
        super().__init__(store, spec, device, per_slot)
        self._load_lock = threading.Lock()  # held while a read writes into the cache
        self._reads_may_start = threading.Event()  # cleared while a cancel waits for the lock
        self._reads_may_start.set()
        # per (layer, K|V), the flat bytes of that plane of the cache, in order; a block's
        # chunk is a slice of each (cheap, no numpy indexing per chunk)
        self._planes: list[memoryview] = []
        self._block_bytes = 0

    def start(self, loads: list[LoadSpec], kv_cache: torch.Tensor) -> None:
        if kv_cache is not self._kv_cache:  # a new cache (once, in practice): its planes
            raw = kv_cache.view(torch.uint8).numpy()  # (L, 2, N, bs, Hkv, D * elem)
            self._block_bytes = raw[0, 0, 0].nbytes
            self._planes = [
                memoryview(raw[layer, kv].reshape(-1))
                for layer in range(raw.shape[0])
                for kv in (0, 1)
            ]
        super().start(loads, kv_cache)

    def _read(self, specs: list[LoadSpec]) -> None:
        """Batches of up to ``per_slot`` entries across requests, in order; each request's part
        of a batch is reported as one ``Fetched`` (its last one with ``last``)."""
        items = [(spec, i) for spec in specs for i in range(len(spec.keys))]
        for lo in range(0, len(items), self.per_slot):
            batch = items[lo : lo + self.per_slot]
            self._reads_may_start.wait()  # a waiting cancel goes first (the lock is not fair)
            with self._load_lock:
                live = [(s, i) for s, i in batch if s.request_id not in self._cancelled]
                ok = self._get_items(live)
            done = dict(zip(((s.request_id, i) for s, i in live), ok))
            parts: dict[int, tuple[LoadSpec, list[int]]] = {}  # by identity, in batch order
            for s, i in batch:
                parts.setdefault(id(s), (s, []))[1].append(i)
            for spec, index in parts.values():
                hits = [done.get((spec.request_id, i), False) for i in index]
                last = index[-1] == len(spec.keys) - 1
                ids = [spec.block_ids[i] for i in index]
                self._arrive(Fetched(spec.request_id, ids, hits, last))

    def _get_items(self, items: list[tuple[LoadSpec, int]]) -> list[bool]:
        if not items:
            return []
        keys = [s.keys[i] for s, i in items]
        tokens = [s.num_tokens[i] for s, i in items]
        out = [self._block_chunks(s.block_ids[i]) for s, i in items]
        try:
            return self.store.get_many_into(keys, tokens, out)
        except Exception:  # a store bug must cost a recompute, never a wrong token
            logger.exception("KV load of %d entries failed", len(keys))
            return [False] * len(keys)

    def _block_chunks(self, block_id: int) -> list[memoryview]:
        """A block's K and V of every layer in the paged cache: one entry's payload, in order."""
        lo = block_id * self._block_bytes
        hi = lo + self._block_bytes
        return [plane[lo:hi] for plane in self._planes]

    def _cancel(self, ended: set[str]) -> None:
        self._reads_may_start.clear()
        with self._load_lock:  # after this, no read writes into an ended request's blocks
            super()._cancel(ended)
        self._reads_may_start.set()

    def close(self) -> None:
        super().close()
        self._planes = []
