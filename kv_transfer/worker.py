"""The worker half of the store connector: moves KV bytes between the paged cache and a store.

```
save   layer l computes → gather its blocks (block_copy) → D2H on the save stream ┐ while layer
       l+1 computes; after the pass the writer puts whole entries                ┘ (background)
load   reader: get entries (CPU: straight into their blocks of the paged cache; CUDA: into a
       staging slot) → the next forward pass, layer l: H2D + scatter on the load stream, the
       compute stream waits for layer l's event only → layer l's attention
```

Save (producer): ``save_kv_layer`` copies the step's blocks of that layer into a staging slot
(``kv_store/staging.py``: a ring of reused buffers, pinned on CUDA, layer-major) in one batched
gather, on CUDA followed by a device→host copy on a side stream that overlaps the next layers'
compute; after the pass a background writer puts whole entries (skipping those the store already
holds). ``wait_for_save`` returns once the prompts that complete in this step are durable; the
blocks of earlier prompt chunks keep being written while later chunks compute.

Load (consumer): a background reader fetches the entries while the engine keeps stepping other
requests; ``get_finished`` reports every block that did not arrive intact (missing, evicted,
corrupt, unreachable) as failed, so the scheduler recomputes from the first failed block. On CPU
the reader reads straight into the request's blocks of the paged cache; on CUDA into staging,
and the next forward pass lands the good blocks layer by layer, each just before its layer's
attention. Output never changes, only speed.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from common.kv_connector import KVConnectorWorker
from common.kv_interface import ConnectorMetadata, KVCacheSpec, LoadSpec
from common.parallel.block_exchange import BlockExchange
from common.sampler import to_device
from kernels.block_copy import gather_blocks, scatter_blocks
from kv_store.base import KVStore
from kv_store.staging import RingClosed, StagingRing, entry_chunks, layer_major

logger = logging.getLogger(__name__)

STAGING_SLOTS = 4  # per direction
STAGING_SLOT_BYTES = 64 * 2**20  # rounded down to whole entries (at least one)


class _SaveGroup(NamedTuple):
    """Up to one staging slot of a step's saves: entry ``i`` is block ``block_ids[i]``."""

    keys: list[str]
    num_tokens: list[int]
    request_ids: list[str]
    block_list: list[int]
    block_ids: torch.Tensor  # (n,) int64 on the cache's device
    slot: torch.Tensor  # the staging slot it fills
    staged: torch.Tensor  # (L, n, 2, bs, Hkv, D) view of the slot


class _Read(NamedTuple):
    """One fetched part of a load, read in place into the paged cache (CPU): ``ok[i]`` says
    whether entry ``i`` arrived intact."""

    request_id: str
    block_ids: list[int]
    ok: list[bool]
    last: bool  # the request's last part


class _Staged(NamedTuple):
    """One fetched part of a load, in a staging slot (``staged``: its layer-major view)."""

    request_id: str
    block_ids: list[int]
    ok: list[bool]
    last: bool
    slot: torch.Tensor
    staged: torch.Tensor


class StoreConnectorWorker(KVConnectorWorker):
    """The byte-moving half. Threads: the engine thread (this object's methods), one writer and
    one reader that drive the store (which spreads a batch over its own I/O workers). Staging
    slots move between them; every device copy runs on a side stream (CUDA) ordered by events,
    so the compute stream never waits for the host."""

    def __init__(
        self,
        store: KVStore,
        spec: KVCacheSpec,
        device: torch.device,
        *,
        staging_slots: int = STAGING_SLOTS,
        slot_bytes: int = STAGING_SLOT_BYTES,
        read_in_place: bool | None = None,
        exchange: BlockExchange | None = None,
    ) -> None:
        """``exchange``: this is rank 0 of a tensor-parallel group, whose cache holds only its
        KV heads; whole blocks (``spec``: every head, the store's layout) move between staging
        and every rank's heads through it, between steps (``common/parallel/block_exchange.py``)
        rather than layer by layer."""
        self.store, self.spec, self.device = store, spec, device
        self.on_cuda = device.type == "cuda"
        self.exchange = exchange
        # CPU: loads read straight into the paged cache; else through staging, landing layer by
        # layer in the next forward pass (the only way on CUDA or with tensor parallelism)
        if read_in_place is None:
            read_in_place = not self.on_cuda and exchange is None
        self.read_in_place = read_in_place
        if self.read_in_place and (self.on_cuda or exchange is not None):
            raise ValueError("a CUDA or tensor-parallel cache cannot be read into in place")
        self.per_slot = max(1, slot_bytes // spec.bytes_per_block)
        slot_bytes = self.per_slot * spec.bytes_per_block
        self.save_ring = StagingRing(staging_slots, slot_bytes, pin=self.on_cuda)
        self.load_ring = StagingRing(staging_slots, slot_bytes, pin=self.on_cuda)
        self._save_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._load_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self._meta = ConnectorMetadata()
        self._kv_cache: torch.Tensor | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-writer")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-reader")
        # save: this step's groups, and each request's writes not yet known durable
        self._step_saves: list[_SaveGroup] = []
        self._pending_saves: dict[str, list[Future]] = {}
        self._done_saving: set[str] = set()
        # load: fetched slots arrive on a queue from the reader; a request's last slot waits
        # in ``_landing`` for the next forward pass, earlier ones land at once
        self._to_fetch: queue.SimpleQueue[LoadSpec] = queue.SimpleQueue()
        self._fetched: queue.SimpleQueue[_Read | _Staged] = queue.SimpleQueue()
        self._loading: set[str] = set()
        self._cancelled: set[str] = set()
        self._load_lock = threading.Lock()  # CPU: held while a read writes into the cache
        self._reads_may_start = threading.Event()  # cleared while a cancel waits for the lock
        self._reads_may_start.set()
        # CPU in place: per (layer, K|V), the flat bytes of that plane of the cache, in order;
        # a block's chunk is a slice of each (cheap, no numpy indexing per chunk)
        self._planes: list[memoryview] = []
        self._block_bytes = 0
        self._landing: list[_Staged] = []
        self._landing_events: list[torch.cuda.Event] = []
        self._releasing: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        # CUDA: per loading request, the event after its last scatter queued outside a forward
        self._scattering: dict[str, torch.cuda.Event] = {}
        self._failed: set[int] = set()
        self.num_saved_blocks = self.num_loaded_blocks = self.num_failed_blocks = 0

    # -- per step ------------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._meta = meta
        entries = [
            (s.request_id, key, block, n)
            for s in meta.saves
            for key, block, n in zip(s.keys, s.block_ids, s.num_tokens)
        ]
        before = self.save_ring.num_slots
        if self.save_ring.ensure_slots(-(-len(entries) // self.per_slot)):
            logger.warning(
                "one step saves %d KV blocks, more than %d staging slots of %d hold: the ring"
                " grew to %d slots (%.0f MiB of host memory)",
                len(entries),
                before,
                self.per_slot,
                self.save_ring.num_slots,
                self.save_ring.num_slots * self.save_ring.slot_bytes / 2**20,
            )
        for lo in range(0, len(entries), self.per_slot):
            part = entries[lo : lo + self.per_slot]
            slot = self.save_ring.acquire()  # waits while the store is behind: back-pressure
            self._step_saves.append(
                _SaveGroup(
                    [key for _, key, _, _ in part],
                    [n for _, _, _, n in part],
                    [rid for rid, _, _, _ in part],
                    [b for _, _, b, _ in part],
                    to_device([b for _, _, b, _ in part], torch.int64, self.device),
                    slot,
                    layer_major(slot, len(part), self.spec),
                )
            )

    def clear_connector_metadata(self) -> None:
        self._meta = ConnectorMetadata()
        for group in self._step_saves:  # bound but never saved (a failed forward pass)
            self.save_ring.release(group.slot)
        self._step_saves = []

    def layer_work_pending(self) -> bool:
        if self.exchange is not None:  # its saves and loads move between steps
            return False
        return bool(self._step_saves or self._landing)

    # -- save path -----------------------------------------------------------------------------
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Copy this step's blocks of ``layer`` into staging: one gather, and on CUDA one DMA on
        the save stream that runs while the next layers compute."""
        for group in self._step_saves:
            dst = group.staged[layer]  # (n, 2, bs, Hkv, D), contiguous
            if self._save_stream is None:
                torch.index_select(kv_layer, 1, group.block_ids, out=dst.transpose(0, 1))
                continue
            packed = gather_blocks(kv_layer.unsqueeze(0), group.block_ids)  # (n, 1, 2, …)
            self._save_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._save_stream):
                dst.copy_(packed.view_as(dst), non_blocking=True)
            packed.record_stream(self._save_stream)

    def wait_for_save(self) -> None:
        """Hand the step's staged blocks to the writer; wait only for prompts that complete now."""
        groups, self._step_saves = self._step_saves, []
        for group in groups:
            copied = None
            if self.exchange is not None:
                copied = self._collect(group)
            elif self._save_stream is not None:
                copied = torch.cuda.Event()
                copied.record(self._save_stream)
            future = self._writer.submit(self._write, group, copied)
            for request_id in dict.fromkeys(group.request_ids):
                self._pending_saves.setdefault(request_id, []).append(future)
        for spec in self._meta.saves:
            if spec.final:
                for future in self._pending_saves.pop(spec.request_id, []):
                    future.result()
                self._done_saving.add(spec.request_id)

    def _collect(self, group: _SaveGroup) -> torch.cuda.Event | None:
        """Tensor parallel: every rank's heads of the group's blocks into its staging slot."""
        assert self.exchange is not None
        full = self.exchange.collect_blocks(group.block_list)  # (L, n, 2, bs, Hkv, D)
        group.staged.copy_(full, non_blocking=self.on_cuda)
        if not self.on_cuda:
            return None
        copied = torch.cuda.Event()
        copied.record()
        return copied

    def _write(self, group: _SaveGroup, copied: torch.cuda.Event | None) -> None:
        """Writer thread: entries not in the store yet are put, one batch; never raises."""
        try:
            if copied is not None:
                copied.synchronize()
            present = self.store.contains_many(group.keys)
            todo = [i for i, p in enumerate(present) if not p]
            if todo:
                chunks = entry_chunks(group.staged)
                ok = self.store.put_many(
                    [group.keys[i] for i in todo],
                    [chunks[i] for i in todo],
                    [group.num_tokens[i] for i in todo],
                )
                self.num_saved_blocks += sum(ok)
                if not all(ok):
                    logger.warning("%d of %d KV entries not saved", len(ok) - sum(ok), len(ok))
        except Exception:  # a lost save only costs the consumer a recompute
            logger.exception("KV save failed")
        finally:
            self.save_ring.release(group.slot)

    # -- load path -----------------------------------------------------------------------------
    def start_load_kv(self, kv_cache: torch.Tensor) -> None:
        """Start this step's fetches in the background (the request stays parked meanwhile)."""
        if self._kv_cache is not kv_cache:
            self._kv_cache = kv_cache
            if self.read_in_place:
                raw = kv_cache.view(torch.uint8).numpy()  # (L, 2, N, bs, Hkv, D * elem)
                self._block_bytes = raw[0, 0, 0].nbytes
                self._planes = [
                    memoryview(raw[layer, kv].reshape(-1))
                    for layer in range(raw.shape[0])
                    for kv in (0, 1)
                ]
        for spec in self._meta.loads:
            self._loading.add(spec.request_id)
            self._to_fetch.put(spec)
        if self._meta.loads:
            self._reader.submit(self._fetch_queued)

    def _fetch_queued(self) -> None:
        """Reader thread: every load queued so far (earlier submissions may have taken them all),
        onto the fetched queue. Never raises: whatever did not arrive intact is a failed block.

        Staged (CUDA): a slot's worth at a time into pinned staging, copied to the device layer
        by layer later. In place (CPU): straight into their blocks of the paged cache, the loads
        of several requests batched into one store call (fewer, fuller batches for the store's
        workers), under the load lock: a request ended meanwhile is cancelled under that lock
        (``get_finished``, before the next ``schedule`` can hand its blocks to anyone else), so
        no read ever writes into a block that is no longer its request's. A failed entry leaves
        its block to be recomputed."""
        specs = []
        while True:
            try:
                specs.append(self._to_fetch.get_nowait())
            except queue.Empty:
                break
        try:
            if self.read_in_place:
                self._read_in_place(specs)
            else:
                for spec in specs:
                    self._read_staged(spec)
        except RingClosed:  # closing: nobody waits for these loads any more
            return
        except Exception:  # a bug here must cost a recompute, never a request parked forever
            logger.exception("KV reader failed; %d loads fall back to recompute", len(specs))
            for spec in specs:  # every block failed: the scheduler recomputes the prompt
                failed = [False] * len(spec.block_ids)
                self._fetched.put(_Read(spec.request_id, spec.block_ids, failed, True))

    def _read_staged(self, spec: LoadSpec) -> None:
        n = len(spec.keys)
        for lo in range(0, n, self.per_slot):
            hi = min(n, lo + self.per_slot)
            slot = self.load_ring.acquire()
            staged = layer_major(slot, hi - lo, self.spec)
            ok = self._get(spec, lo, hi, entry_chunks(staged))
            ids = spec.block_ids[lo:hi]
            self._fetched.put(_Staged(spec.request_id, ids, ok, hi == n, slot, staged))

    def _read_in_place(self, specs: list[LoadSpec]) -> None:
        """Batches of up to ``per_slot`` entries across requests, in order; each request's
        part of a batch is reported as one ``_Read`` (its last one with ``last``)."""
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
                self._fetched.put(
                    _Read(spec.request_id, [spec.block_ids[i] for i in index], hits, last)
                )

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

    def _get(self, spec: LoadSpec, lo: int, hi: int, out: list[list[memoryview]]) -> list[bool]:
        try:
            return self.store.get_many_into(spec.keys[lo:hi], spec.num_tokens[lo:hi], out)
        except Exception:  # a store bug must cost a recompute, never a wrong token
            logger.exception("KV load failed for %s", spec.request_id)
            return [False] * (hi - lo)

    def _block_chunks(self, block_id: int) -> list[memoryview]:
        """A block's K and V of every layer in the paged cache: one entry's payload, in order."""
        lo = block_id * self._block_bytes
        hi = lo + self._block_bytes
        return [plane[lo:hi] for plane in self._planes]

    def wait_for_layer_load(self, layer: int) -> None:
        """Layer ``layer`` of every fetched load is in the paged cache before that layer's
        attention: layer 0 computes while later layers are still on their way. On CUDA all
        layers' copies are queued on the load stream at layer 0, and each layer's attention
        waits for its own event only; on CPU each layer is copied here.

        Fetched blocks are scattered within the first forward pass after they arrived, and
        that pass is the first that can read them (a prefix hit on them included)."""
        if not self._landing or self._kv_cache is None:
            return
        if self._load_stream is None:
            for item in self._landing:
                self._scatter_layer(layer, item)
        else:
            if layer == 0:
                self._landing_events = self._queue_landing(self._landing)
            torch.cuda.current_stream(self.device).wait_event(self._landing_events[layer])
        if layer == self.spec.num_layers - 1:
            for item in self._landing:
                self._release_after_copy(item.slot)
            self._landing = []

    def _scatter_layer(self, layer: int, item: _Staged) -> None:
        """CPU: one layer of a fetched slot into the cache (good entries only)."""
        assert self._kv_cache is not None
        good = [i for i, hit in enumerate(item.ok) if hit]
        if not good:
            return
        src = item.staged[layer]
        ids = torch.tensor([item.block_ids[i] for i in good])
        if len(good) != len(item.ok):
            src = src.index_select(0, torch.tensor(good))
        self._kv_cache[layer].index_copy_(1, ids, src.transpose(0, 1))

    def _queue_landing(self, items: list[_Staged]) -> list[torch.cuda.Event]:
        """CUDA: per layer, host→device copy of each slot's layer and one scatter into the
        cache, on the load stream after the compute stream's work so far; an event per layer."""
        assert self._kv_cache is not None and self._load_stream is not None
        plans = []
        for item in items:
            good = [i for i, hit in enumerate(item.ok) if hit]
            ids = to_device([item.block_ids[i] for i in good], torch.int64, self.device)
            sel = to_device(good, torch.int64, self.device) if len(good) < len(item.ok) else None
            for t in (ids, sel):  # made on the compute stream, read on the load stream
                if t is not None:
                    t.record_stream(self._load_stream)
            plans.append((item, ids, sel))
        # after the index copies above, and after every earlier write into these blocks
        self._load_stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        with torch.cuda.stream(self._load_stream):
            for layer in range(self.spec.num_layers):
                for item, ids, sel in plans:
                    if ids.numel():
                        dev = item.staged[layer].to(self.device, non_blocking=True)
                        if sel is not None:
                            dev = dev.index_select(0, sel)
                        scatter_blocks(self._kv_cache[layer].unsqueeze(0), ids, dev.unsqueeze(1))
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        return events

    def _land_now(self, item: _Staged) -> None:
        """A fetched slot that is not its request's last: into the cache at once, all layers."""
        if self._kv_cache is None:
            self.load_ring.release(item.slot)
            return
        if self.exchange is not None:
            good = [i for i, hit in enumerate(item.ok) if hit]
            if len(good) == len(item.ok):
                self.exchange.land_blocks(item.block_ids, item.staged)
            elif good:
                full = item.staged.index_select(1, torch.tensor(good))
                self.exchange.land_blocks([item.block_ids[i] for i in good], full)
            self.load_ring.release(item.slot)  # the exchange copied it (synchronously)
        elif self._load_stream is None:
            for layer in range(self.spec.num_layers):
                self._scatter_layer(layer, item)
            self.load_ring.release(item.slot)
        else:  # nothing on the compute stream waits for these: remembered for an abort
            self._scattering[item.request_id] = self._queue_landing([item])[-1]
            self._release_after_copy(item.slot)

    def _release_after_copy(self, slot: torch.Tensor) -> None:
        if self._load_stream is None:
            self.load_ring.release(slot)
            return
        done = torch.cuda.Event()
        done.record(self._load_stream)
        self._releasing.append((done, slot))

    def get_finished(self, request_ids: set[str]) -> tuple[set[str], set[str]]:
        """``request_ids``: requests the scheduler ended since the last call (their loads are
        dropped, never scattered into blocks that may already be reused)."""
        if request_ids:
            self._reads_may_start.clear()
            with self._load_lock:  # after this, no read writes into an ended request's blocks
                for request_id in request_ids:
                    self._pending_saves.pop(request_id, None)
                    if request_id in self._loading:
                        self._cancelled.add(request_id)
            self._reads_may_start.set()
        self._drop_ended_loads(request_ids)
        done_loading = self._drain_fetched()
        self._releasing = [(e, s) for e, s in self._releasing if not self._release_if_done(e, s)]
        done_saving, self._done_saving = self._done_saving, set()
        return done_saving, done_loading

    def _drop_ended_loads(self, request_ids: set[str]) -> None:
        """Ended requests' loads: a fetched part still waiting to land gives its staging slot
        back (it would never land), and on CUDA the compute stream waits for every scatter
        already queued into their blocks, which the scheduler is about to hand to new owners
        (whose writes, on the compute stream, must come after)."""
        keep = []
        for item in self._landing:
            if item.request_id in request_ids:
                self.load_ring.release(item.slot)
            else:
                keep.append(item)
        self._landing = keep
        for request_id in request_ids:
            scattered = self._scattering.pop(request_id, None)
            if scattered is not None:
                torch.cuda.current_stream(self.device).wait_event(scattered)

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
                if isinstance(item, _Staged):
                    self.load_ring.release(item.slot)
                if item.last:
                    self._cancelled.discard(item.request_id)
                continue
            good = sum(item.ok)
            self._failed.update(b for b, hit in zip(item.block_ids, item.ok) if not hit)
            self.num_loaded_blocks += good
            self.num_failed_blocks += len(item.ok) - good
            if isinstance(item, _Read):  # read in place (CPU)
                if item.last:
                    done.add(item.request_id)
            elif self.exchange is not None:  # tensor parallel: every part lands now
                self._land_now(item)
                if item.last:
                    done.add(item.request_id)
            elif item.last:  # lands in the next pass, whose layers wait for it (and before)
                self._landing.append(item)
                self._scattering.pop(item.request_id, None)
                done.add(item.request_id)
            else:
                self._land_now(item)

    def _release_if_done(self, event: torch.cuda.Event, slot: torch.Tensor) -> bool:
        if not event.query():
            return False
        self.load_ring.release(slot)
        return True

    def get_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    def close(self) -> None:
        """Stop the threads and give the staging memory back; idempotent. Queued saves are
        written first; loads in flight are dropped (a reader waiting for a slot gives up)."""
        self.load_ring.close()
        self._reader.shutdown(wait=True, cancel_futures=True)
        self._writer.shutdown(wait=True)
        self.save_ring.close()
        for stream in (self._save_stream, self._load_stream):
            if stream is not None:  # no copy still reads or writes a slot about to be freed
                stream.synchronize()
        self._landing, self._releasing, self._landing_events = [], [], []
        while not self._fetched.empty():
            self._fetched.get_nowait()
        self._kv_cache, self._planes = None, []
        self.store.close()
