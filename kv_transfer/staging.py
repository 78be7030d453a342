"""Host staging for the KV connector: a ring of fixed-size, reused buffers.

```
 paged cache (device)                staging slot (host; pinned on CUDA)         store
 kv_cache[l, :, block_ids] ──gather──▶ [ layer 0 | layer 1 | … | layer L-1 ] ──put──▶ entries
                           ◀─scatter──   each layer: (n, 2, bs, Hkv, D)     ◀─get───
```

A slot holds up to ``entries_per_slot`` entries *layer-major*: layer ``l`` of all ``n`` entries is
one contiguous run, so the copy of one layer between device and host is a single DMA transfer
(launched right after that layer computes), and entry ``i``'s payload is the ``L`` chunks
``staged[l, i]`` — the store writes and reads them as one entry (scatter/gather I/O), so the
on-store layout stays ``(L, 2, bs, Hkv, D)`` per block.

Pinned memory is slow to allocate (the driver pins page by page), so slots are made on first
use and recycled forever. ``acquire`` blocks while every slot is taken: that is the back-pressure
that keeps a producer from outrunning its store with unbounded memory. A step takes all its
slots before its forward pass and gives them back only after it, so the ring grows (with a
warning) to what one step needs: waiting for a slot only that step could free never ends.
"""

from __future__ import annotations

import queue
import threading

import torch

from common.kv_interface import KVCacheSpec


class RingClosed(RuntimeError):
    """``acquire`` on a closed ring (its owner is shutting down)."""


class StagingRing:
    """``num_slots`` host buffers of ``slot_bytes`` bytes. Thread-safe."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool) -> None:
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs slots of bytes, got {num_slots} x {slot_bytes}")
        self.num_slots, self.slot_bytes, self.pin = num_slots, slot_bytes, pin
        self._free: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()  # None: closed
        self._lock = threading.Lock()
        self._made = 0
        self._closed = False

    def acquire(self) -> torch.Tensor:
        """A free slot (uint8, ``slot_bytes``); waits for one when all are in use. Raises
        ``RingClosed`` once the ring is closed, a waiter included."""
        try:
            slot = self._free.get_nowait()
        except queue.Empty:
            with self._lock:
                if self._closed:
                    raise RingClosed("the staging ring is closed") from None
                if self._made < self.num_slots:
                    self._made += 1
                    return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self.pin)
            slot = self._free.get()
        if slot is None:  # closed: pass the wake-up on to the next waiter
            self._free.put(None)
            raise RingClosed("the staging ring is closed")
        return slot

    def release(self, slot: torch.Tensor) -> None:
        with self._lock:
            if not self._closed:  # after close, a returned slot is just dropped
                self._free.put(slot)

    def close(self) -> None:
        """Drop the free slots (their memory goes once no one else holds them) and wake every
        waiter with ``RingClosed``. Idempotent."""
        with self._lock:
            self._closed = True
            while True:
                try:
                    self._free.get_nowait()
                except queue.Empty:
                    break
            self._free.put(None)

    def ensure_slots(self, needed: int) -> bool:
        """Let the ring hold at least ``needed`` slots (the most one step takes at once): a
        step that needs more slots than exist would wait for its own, forever. Returns whether
        it grew (the caller warns: staging memory is larger than configured)."""
        with self._lock:
            if needed <= self.num_slots:
                return False
            self.num_slots = needed
            return True

    @property
    def num_allocated(self) -> int:
        return self._made


def layer_major(slot: torch.Tensor, num_entries: int, spec: KVCacheSpec) -> torch.Tensor:
    """The first ``num_entries`` entries of a slot as ``(L, n, 2, bs, Hkv, D)`` in the KV dtype."""
    shape = (spec.num_layers, num_entries, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    nbytes = num_entries * spec.bytes_per_block
    if nbytes > slot.numel():
        raise ValueError(f"{num_entries} entries of {spec.bytes_per_block} B exceed the slot")
    return slot[:nbytes].view(spec.dtype).view(shape)


def entry_chunks(staged: torch.Tensor) -> list[list[memoryview]]:
    """Per entry of a layer-major ``(L, n, …)`` host tensor, its ``L`` per-layer byte chunks
    (the entry's payload in order). Views, no copies."""
    num_layers, n = staged.shape[0], staged.shape[1]
    raw = staged.view(torch.uint8).numpy().reshape(num_layers, n, -1)
    return [[memoryview(raw[layer, i]) for layer in range(num_layers)] for i in range(n)]
