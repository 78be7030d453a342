"""Savers: a step's computed blocks from the paged cache into the store, one class per placement.

```
CopySaver      CPU         layer l computes → its blocks copied into a staging slot (one gather)
StreamSaver    CUDA        layer l computes → gather (block_copy) → D2H on the save stream,
                           overlapping layer l+1's compute
ExchangeSaver  TP rank 0   after the step: every rank's heads of the blocks gathered at rank 0
                           (common/parallel/block_exchange.py) → staging
all three      → the writer thread puts whole entries (skipping those the store already holds)
```

Per step: ``bind`` takes staging slots for the step's saves (``staging.py``: a ring of reused
buffers, layer-major; a step needing more slots than the ring holds grows it, with a warning,
rather than wait for slots only its own writes would free), ``save_layer`` fills them as each
layer computes, ``flush`` hands them to the writer and returns once the prompts that complete in
this step are durable; the blocks of earlier prompt chunks keep being written while later chunks
compute. ``clear`` gives back the slots of a step that failed before its flush.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from common.kv_interface import KVCacheSpec, SaveSpec
from common.parallel.block_exchange import BlockExchange
from common.sampler import to_device
from kernels.block_copy import gather_blocks
from kv_store.base import KVStore
from kv_transfer.staging import StagingRing, entry_chunks, layer_major

logger = logging.getLogger(__name__)


class _SaveGroup(NamedTuple):
    """Up to one staging slot of a step's saves: entry ``i`` is block ``block_ids[i]``."""

    keys: list[str]
    num_tokens: list[int]
    request_ids: list[str]
    block_list: list[int]
    block_ids: torch.Tensor  # (n,) int64 on the cache's device
    slot: torch.Tensor  # the staging slot it fills
    staged: torch.Tensor  # (L, n, 2, bs, Hkv, D) view of the slot


class Saver(ABC):
    """Staging and writing, whatever the placement. Threads: the engine thread (these methods)
    and one writer that drives the store; staging slots go from the one to the other."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, ring: StagingRing):
        self.store, self.spec, self.device, self.ring = store, spec, device, ring
        self.per_slot = ring.slot_bytes // spec.bytes_per_block
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-writer")
        self._groups: list[_SaveGroup] = []  # this step's, bound and not yet flushed
        self._pending: dict[str, list[Future]] = {}  # request id → writes not known durable
        self._done: set[str] = set()
        self.num_saved_blocks = 0

    def bind(self, saves: list[SaveSpec]) -> None:
        """Take staging slots for this step's saves (waits while the store is behind)."""
        entries = [
            (s.request_id, key, block, n)
            for s in saves
            for key, block, n in zip(s.keys, s.block_ids, s.num_tokens)
        ]
        self._grow_for(len(entries))
        for lo in range(0, len(entries), self.per_slot):
            part = entries[lo : lo + self.per_slot]
            slot = self.ring.acquire()  # waits while the store is behind: back-pressure
            blocks = [b for _, _, b, _ in part]
            self._groups.append(
                _SaveGroup(
                    [key for _, key, _, _ in part],
                    [n for _, _, _, n in part],
                    [rid for rid, _, _, _ in part],
                    blocks,
                    to_device(blocks, torch.int64, self.device),
                    slot,
                    layer_major(slot, len(part), self.spec),
                )
            )

    def _grow_for(self, num_entries: int) -> None:
        before = self.ring.num_slots
        if self.ring.ensure_slots(-(-num_entries // self.per_slot)):
            logger.warning(
                "one step saves %d KV blocks, more than %d staging slots of %d hold: the ring"
                " grew to %d slots (%.0f MiB of host memory)",
                num_entries,
                before,
                self.per_slot,
                self.ring.num_slots,
                self.ring.num_slots * self.ring.slot_bytes / 2**20,
            )

    def clear(self) -> None:
        for group in self._groups:  # bound but never flushed (a failed forward pass)
            self.ring.release(group.slot)
        self._groups = []

    def layer_work_pending(self) -> bool:
        return bool(self._groups)

    @abstractmethod
    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        """Layer ``layer`` of this step's blocks (``kv_layer``: the cache's view of it) into
        staging, right after that layer computed."""

    def flush(self, saves: list[SaveSpec]) -> None:
        """Hand the step's staged blocks to the writer; wait only for prompts that complete now."""
        groups, self._groups = self._groups, []
        for group in groups:
            future = self._writer.submit(self._write, group, self._staged(group))
            for request_id in dict.fromkeys(group.request_ids):
                self._pending.setdefault(request_id, []).append(future)
        for spec in saves:
            if spec.final:
                for future in self._pending.pop(spec.request_id, []):
                    future.result()
                self._done.add(spec.request_id)

    def _staged(self, group: _SaveGroup) -> torch.cuda.Event | None:
        """Complete the group's staging; the event the writer waits for (None: it is done)."""
        return None

    def finished(self, ended: set[str]) -> set[str]:
        """Requests whose prompts were saved since the last call (``ended``: forget them)."""
        for request_id in ended:
            self._pending.pop(request_id, None)
        done, self._done = self._done, set()
        return done

    def _write(self, group: _SaveGroup, staged: torch.cuda.Event | None) -> None:
        """Writer thread: entries not in the store yet are put, one batch; never raises."""
        try:
            if staged is not None:
                staged.synchronize()
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
            self.ring.release(group.slot)

    def close(self) -> None:
        """Queued writes are finished first; then the staging memory goes."""
        self._writer.shutdown(wait=True)
        self.ring.close()


class CopySaver(Saver):
    """CPU: each layer's blocks copied into staging on the engine thread, in one gather."""

    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        for group in self._groups:
            dst = group.staged[layer]  # (n, 2, bs, Hkv, D), contiguous
            torch.index_select(kv_layer, 1, group.block_ids, out=dst.transpose(0, 1))


class StreamSaver(Saver):
    """CUDA: each layer's blocks gathered on the compute stream, then copied to pinned staging
    on the save stream, which runs while the next layers compute."""

    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device, ring: StagingRing):
        super().__init__(store, spec, device, ring)
        self._stream = torch.cuda.Stream(device)

    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        for group in self._groups:
            dst = group.staged[layer]  # (n, 2, bs, Hkv, D), contiguous
            packed = gather_blocks(kv_layer.unsqueeze(0), group.block_ids)  # (n, 1, 2, …)
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(packed.view_as(dst), non_blocking=True)
            packed.record_stream(self._stream)

    def _staged(self, group: _SaveGroup) -> torch.cuda.Event:
        copied = torch.cuda.Event()
        copied.record(self._stream)
        return copied

    def close(self) -> None:
        self._stream.synchronize()  # no copy still writes a slot about to be freed
        super().close()


class ExchangeSaver(Saver):
    """Tensor parallel, rank 0: nothing per layer; after the step every rank's heads of the
    blocks are gathered at rank 0 (a collective between steps) and copied into staging."""

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

    def layer_work_pending(self) -> bool:
        return False  # its blocks move after the step, never inside the forward pass

    def save_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        raise AssertionError("a tensor-parallel step runs without per-layer hooks")

    def _staged(self, group: _SaveGroup) -> torch.cuda.Event | None:
        full = self.exchange.collect_blocks(group.block_list)  # (L, n, 2, bs, Hkv, D)
        on_cuda = full.device.type == "cuda"
        group.staged.copy_(full, non_blocking=on_cuda)
        if not on_cuda:
            return None
        copied = torch.cuda.Event()
        copied.record()
        return copied
