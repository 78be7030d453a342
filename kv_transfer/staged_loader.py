"""Loaders that read through staging (``staging.py``): the CUDA path, its CPU twin, and tensor
parallelism. The reader fills a slot with up to ``per_slot`` of a request's entries at a time;
what happens to a filled slot is the placement (see ``loader.py`` for the picture).

NOTE (CUDA ordering). Parts land on the load stream. The last part of a request lands in the
next forward pass, and each layer's attention waits for its layer's event; earlier parts land
at once, and nothing on the compute stream waits for them. So until a request's last part has
landed, its latest such scatter is remembered (``StreamLoader._scattering``): if the request
ends first, the compute stream waits for it before the scheduler's next owner of those blocks
writes them.
"""

from __future__ import annotations

from abc import abstractmethod

import torch

from common.kv_interface import KVCacheSpec, LoadSpec
from common.parallel.block_exchange import BlockExchange
from common.sampler import to_device
from kernels.block_copy import scatter_blocks
from kv_store.base import KVStore
from kv_transfer.loader import Fetched, Loader, logger
from kv_transfer.staging import StagingRing, entry_chunks, layer_major


class SlotLoader(Loader):
    """Reads a slot's worth of a request's entries at a time into a slot of ``ring``."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, ring: StagingRing):
        super().__init__(store, spec, device, ring.slot_bytes // spec.bytes_per_block)
        self.ring = ring

    def _read(self, specs: list[LoadSpec]) -> None:
        for spec in specs:
            n = len(spec.keys)
            for lo in range(0, n, self.per_slot):
                hi = min(n, lo + self.per_slot)
                slot = self.ring.acquire()  # waits while every slot is landing
                staged = layer_major(slot, hi - lo, self.spec)
                ok = self._get(spec, lo, hi, entry_chunks(staged))
                ids = spec.block_ids[lo:hi]
                self._arrive(Fetched(spec.request_id, ids, ok, hi == n, slot, staged))

    def _get(self, spec: LoadSpec, lo: int, hi: int, out: list[list[memoryview]]) -> list[bool]:
        try:
            return self.store.get_many_into(spec.keys[lo:hi], spec.num_tokens[lo:hi], out)
        except Exception:  # a store bug must cost a recompute, never a wrong token
            logger.exception("KV load failed for %s", spec.request_id)
            return [False] * (hi - lo)

    def _arrived(self, item: Fetched) -> bool:
        if item.slot is None:  # nothing was read (the reader failed): nothing to land
            return item.last
        return self._land(item)

    @abstractmethod
    def _land(self, item: Fetched) -> bool:
        """A staged part of a live request: land it now or keep it for the next forward pass
        (its slot goes back once copied); whether its request's load is done."""

    def _discard(self, item: Fetched) -> None:
        if item.slot is not None:
            self.ring.release(item.slot)

    def close(self) -> None:
        self.ring.close()  # first: a reader waiting for a slot gives up
        super().close()


class StagedLoader(SlotLoader):
    """CPU, the CUDA path's twin (``read_in_place=False``): a request's earlier parts land at
    once; its last part waits in ``landing`` for the next forward pass, which copies it layer by
    layer just before each layer's attention (that pass is the first that can read the blocks,
    a prefix hit on them included)."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, ring: StagingRing):
        super().__init__(store, spec, device, ring)
        self.landing: list[Fetched] = []  # last parts, for the next forward pass

    def _land(self, item: Fetched) -> bool:
        if item.last:
            self.landing.append(item)
            return True
        self._land_now(item)
        return False

    def _land_now(self, item: Fetched) -> None:
        """A part that is not its request's last: into the cache at once, every layer."""
        for layer in range(self.spec.num_layers):
            self._scatter_layer(layer, item)
        self._release_after_copy(item)

    def layer_work_pending(self) -> bool:
        return bool(self.landing)

    def wait_for_layer(self, layer: int) -> None:
        if not self.landing:
            return
        for item in self.landing:
            self._scatter_layer(layer, item)
        if layer == self.spec.num_layers - 1:
            self._landed()

    def _landed(self) -> None:
        """The last layer of every landing part is queued: their slots go back once copied."""
        for item in self.landing:
            self._release_after_copy(item)
        self.landing = []

    def _release_after_copy(self, item: Fetched) -> None:
        assert item.slot is not None
        self.ring.release(item.slot)

    def _drop_ended(self, ended: set[str]) -> None:
        """An ended request's part still waiting to land gives its slot back (it never lands)."""
        keep = []
        for item in self.landing:
            if item.request_id in ended:
                self._discard(item)
            else:
                keep.append(item)
        self.landing = keep

    def _scatter_layer(self, layer: int, item: Fetched) -> None:
        """One layer of a fetched slot into the cache (good entries only)."""
        assert self._kv_cache is not None and item.staged is not None
        good = [i for i, hit in enumerate(item.ok) if hit]
        if not good:
            return
        src = item.staged[layer]
        ids = torch.tensor([item.block_ids[i] for i in good])
        if len(good) != len(item.ok):
            src = src.index_select(0, torch.tensor(good))
        # as bytes: the same copy for every cache dtype (index_copy_ has no float8 CPU kernel)
        dst = self._kv_cache[layer].view(torch.uint8)
        dst.index_copy_(1, ids, src.view(torch.uint8).transpose(0, 1))


class StreamLoader(StagedLoader):
    """CUDA: host→device copies and scatters on the load stream, ordered by events; the compute
    stream never waits for the host, and each layer's attention only for its own layer."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, ring: StagingRing):
        super().__init__(store, spec, device, ring)
        self._stream = torch.cuda.Stream(device)
        self._events: list[torch.cuda.Event] = []  # per layer, of the landing parts
        self._releasing: list[tuple[torch.cuda.Event, torch.Tensor]] = []
        self._scattering: dict[str, torch.cuda.Event] = {}  # see the NOTE above

    def _land_now(self, item: Fetched) -> None:
        self._scattering[item.request_id] = self._queue_landing([item])[-1]
        self._release_after_copy(item)

    def wait_for_layer(self, layer: int) -> None:
        """All layers' copies are queued at layer 0; each layer's attention waits for its own."""
        if not self.landing:
            return
        if layer == 0:
            self._events = self._queue_landing(self.landing)
        torch.cuda.current_stream(self.device).wait_event(self._events[layer])
        if layer == self.spec.num_layers - 1:
            for item in self.landing:  # the compute stream now waits for all of its scatters
                self._scattering.pop(item.request_id, None)
            self._landed()

    def _queue_landing(self, items: list[Fetched]) -> list[torch.cuda.Event]:
        """Per layer, host→device copy of each slot's layer and one scatter into the cache, on
        the load stream after the compute stream's work so far; an event per layer."""
        assert self._kv_cache is not None
        plans = []
        for item in items:
            good = [i for i, hit in enumerate(item.ok) if hit]
            ids = to_device([item.block_ids[i] for i in good], torch.int64, self.device)
            sel = to_device(good, torch.int64, self.device) if len(good) < len(item.ok) else None
            for t in (ids, sel):  # made on the compute stream, read on the load stream
                if t is not None:
                    t.record_stream(self._stream)
            plans.append((item.staged, ids, sel))
        # after the index copies above, and after every earlier write into these blocks
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        events = []
        with torch.cuda.stream(self._stream):
            for layer in range(self.spec.num_layers):
                for staged, ids, sel in plans:
                    if ids.numel():
                        dev = staged[layer].to(self.device, non_blocking=True)
                        if sel is not None:
                            dev = dev.index_select(0, sel)
                        scatter_blocks(self._kv_cache[layer].unsqueeze(0), ids, dev.unsqueeze(1))
                event = torch.cuda.Event()
                event.record()
                events.append(event)
        return events

    def _release_after_copy(self, item: Fetched) -> None:
        assert item.slot is not None
        done = torch.cuda.Event()
        done.record(self._stream)
        self._releasing.append((done, item.slot))

    def finished(self, ended: set[str]) -> set[str]:
        done = super().finished(ended)
        self._releasing = [(e, s) for e, s in self._releasing if not self._release_if_done(e, s)]
        return done

    def _release_if_done(self, event: torch.cuda.Event, slot: torch.Tensor) -> bool:
        if not event.query():
            return False
        self.ring.release(slot)
        return True

    def _drop_ended(self, ended: set[str]) -> None:
        """Besides the parked parts: the compute stream waits for every scatter already queued
        into the ended requests' blocks, which the scheduler is about to hand to new owners
        (whose writes, on the compute stream, must come after)."""
        super()._drop_ended(ended)
        for request_id in ended:
            scattered = self._scattering.pop(request_id, None)
            if scattered is not None:
                torch.cuda.current_stream(self.device).wait_event(scattered)

    def close(self) -> None:
        self._stream.synchronize()  # no copy still reads a slot about to be freed
        super().close()
        self.landing, self._releasing, self._events = [], [], []


class ExchangeLoader(SlotLoader):
    """Tensor parallel, rank 0: every part lands as it arrives, between steps, through the
    block exchange (a collective every rank joins) into every rank's heads; nothing waits in
    staging for a forward pass, and the forward pass has no per-layer work."""

    def __init__(
        self,
        store: KVStore,
        spec: KVCacheSpec,
        device: torch.device,
        ring: StagingRing,
        exchange: BlockExchange,
    ) -> None:
        super().__init__(store, spec, device, ring)
        self.exchange = exchange

    def _land(self, item: Fetched) -> bool:
        assert item.slot is not None and item.staged is not None
        good = [i for i, hit in enumerate(item.ok) if hit]
        if len(good) == len(item.ok):
            self.exchange.land_blocks(item.block_ids, item.staged)
        elif good:
            full = item.staged.index_select(1, torch.tensor(good))
            self.exchange.land_blocks([item.block_ids[i] for i in good], full)
        self.ring.release(item.slot)  # the exchange copied it (synchronously)
        return item.last
