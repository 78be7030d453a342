"""A host-memory KV tier behind the device's prefix cache (``--kv-offload-gb``).

NOTE: how a block moves between the tiers. A full block of the prefix cache lives on the device
until the pool hands it to someone else (``BlockPool``: LRU eviction from the free queue). With a
host tier the eviction is not the end: the scheduler gives the block's hash a host slot (LRU over
the slots) and the step copies the block there before anything writes it. A later lookup goes
device → host tier → store connector, in that order: blocks found in the host tier are copied
into freshly allocated device blocks before the step's forward and count as computed, and only
what neither tier holds is asked of the store (so a decode node's loads read the host tier
first) or computed.

```
  scheduler (plain ints, HostTierIndex)          runner (tensors, HostKVTier)
  evict b (hash h) → slot s = LRU victim    ──▶  offloads: host[s] ← kv[:, :, b]   (first)
  lookup h' → slot s'; new block b'         ──▶  loads:    kv[:, :, b'] ← host[s'] (then)
                                                 forward of the step
```

The two halves agree through ``HostCopies``, built by the scheduler and carried in the
``SchedulerOutput``. Ordering makes it safe without waits: every copy is queued on the device
stream before the step that might overwrite its source (on CUDA the host tensor is pinned and
the copies are asynchronous; the step in flight, if any, is ahead of them in the stream), a slot
read by a load this step is pinned so no offload of the same step reuses it, and offloads run
before loads (a block evicted and reloaded in one step keeps both contents straight). A block
is offloaded only when the pool drops its cache entry, never at prefix-cache resets (a reset
says the cache may hold bad KV: the host tier is cleared with it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from common.block_hash import BlockHash

if TYPE_CHECKING:  # the scheduler's half is plain ints: no torch import for it
    import torch


class HostCopies(NamedTuple):
    """One step's copies between the device cache and the host tier."""

    offloads: list[tuple[int, int]]  # (device block, host slot): device → host, run first
    loads: list[tuple[int, int]]  # (host slot, device block): host → device, run after


class SwappedKV(NamedTuple):
    """A preempted request's blocks that the prefix cache cannot find again (the partial last
    block, and full blocks whose hash was not known yet), offloaded under keys of their own."""

    first_block: int  # the request's block index of ``keys[0]``
    keys: list[bytes]
    num_tokens: int  # its computed tokens when it was preempted


def swap_key(request_id: str, block: int, num_tokens: int) -> bytes:
    """A swapped block's key: never a block hash (those are 32 bytes of SHA-256)."""
    return f"swap:{request_id}:{block}:{num_tokens}".encode()


class HostTierStats(NamedTuple):
    offloaded_blocks: int  # blocks copied to the host tier
    loaded_blocks: int  # blocks copied back (prefix hits served by the host tier)
    dropped_blocks: int  # evicted blocks the tier had no free, unpinned slot for


class HostTierIndex:
    """The scheduler's half: which block hash is in which host slot, in LRU order. Plain ints."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"a host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots this step's loads read
        self._offloads: list[tuple[int, int]] = []
        self._loads: list[tuple[int, int]] = []
        self._released: list[int] = []  # slots forgotten this step: free from the next one
        self._counts = [0, 0, 0]

    def __len__(self) -> int:
        return len(self._slots)

    def lookup(self, hashes: Sequence[BlockHash]) -> list[int]:
        """The slots of the leading run of ``hashes`` the tier holds. No side effects."""
        slots = []
        for block_hash in hashes:
            slot = self._slots.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def pin(self, hashes: Sequence[BlockHash]) -> None:
        """Mark the slots of ``hashes`` (a lookup's) most recently used and keep them for this
        step's loads: no offload of this step may take them."""
        for block_hash in hashes:
            self._slots.move_to_end(block_hash)
            self._pinned.add(self._slots[block_hash])

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Copy the pinned slots of ``hashes`` into ``block_ids`` before this step's forward."""
        for block_hash, block_id in zip(hashes, block_ids, strict=True):
            self._loads.append((self._slots[block_hash], block_id))
        self._counts[1] += len(block_ids)

    def offload(self, block_id: int, block_hash: BlockHash) -> bool:
        """Device block ``block_id`` is about to be reused: keep its KV under ``block_hash``.
        False when the tier has no free or unpinned slot (the block is dropped)."""
        if block_hash in self._slots:  # the same KV is already here
            self._slots.move_to_end(block_hash)
            return True
        slot = self._take_slot()
        if slot is None:
            self._counts[2] += 1
            return False
        self._slots[block_hash] = slot
        self._offloads.append((block_id, slot))
        self._counts[0] += 1
        return True

    def forget(self, keys: Sequence[BlockHash]) -> None:
        """Drop ``keys`` (a resumed request's swapped blocks: used once). Their slots are free
        from the next step on (a load of this step may still read them)."""
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                self._released.append(slot)

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for block_hash, slot in self._slots.items():  # least recently used first
            if slot not in self._pinned:
                del self._slots[block_hash]
                return slot
        return None

    def take_copies(self) -> HostCopies | None:
        """This step's copies (None: none); the next step starts with no pins."""
        self._pinned.clear()
        self._free += self._released
        self._released = []
        if not self._offloads and not self._loads:
            return None
        copies = HostCopies(self._offloads, self._loads)
        self._offloads, self._loads = [], []
        return copies

    def clear(self) -> None:
        """Forget every entry (copies already handed out stay valid: they are queued first)."""
        self._slots.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()
        self._released = []

    def stats(self) -> HostTierStats:
        return HostTierStats(*self._counts)


class HostKVTier:
    """The runner's half: the host tensor of ``num_slots`` blocks × all layers, and the copies.
    Pinned on CUDA (the copies are asynchronous, queued on the current stream)."""

    def __init__(self, num_slots: int, kv_cache: torch.Tensor) -> None:
        import torch

        # kv_cache: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        block_shape = kv_cache[:, :, 0].shape
        on_cuda = kv_cache.device.type == "cuda"
        self.host = torch.empty((num_slots, *block_shape), dtype=kv_cache.dtype, pin_memory=on_cuda)
        self.num_slots = num_slots

    @staticmethod
    def num_slots_for(gib: float, bytes_per_block: int) -> int:
        return int(gib * 2**30) // bytes_per_block

    def copy(self, copies: HostCopies, kv_cache: torch.Tensor) -> None:
        """Offloads, then loads. On the CPU one strided copy per block (2.3x faster than a
        gather and a scatter over the cache for 256 KiB blocks, 6.5x for 1 MiB; even for
        32 KiB: docs/BENCHMARKS.md). On CUDA the connector's block packing
        (``kernels/block_copy.py``: one launch gathers or scatters every block of the step
        through a device staging buffer) and one asynchronous copy per run of consecutive
        host slots (slots are handed out in order, so a step's are mostly one run)."""
        if kv_cache.device.type == "cpu":
            for block, slot in copies.offloads:
                self.host[slot].copy_(kv_cache[:, :, block])
            for slot, block in copies.loads:
                kv_cache[:, :, block].copy_(self.host[slot])
        else:
            self.copy_staged(copies, kv_cache)

    def copy_staged(self, copies: HostCopies, kv_cache: torch.Tensor) -> None:
        """``copy``'s CUDA path (on CPU tensors, through Triton's interpreter: tests)."""
        import torch

        from common.sampler import to_device  # pinned, asynchronous index upload
        from kernels.block_copy import gather_blocks, scatter_blocks

        device = kv_cache.device
        if copies.offloads:
            blocks, slots = (list(v) for v in zip(*copies.offloads, strict=True))
            staged = gather_blocks(kv_cache, to_device(blocks, torch.int64, device))
            for row, slot, n in slot_runs(slots):
                self.host[slot : slot + n].copy_(staged[row : row + n], non_blocking=True)
        if copies.loads:
            slots, blocks = (list(v) for v in zip(*copies.loads, strict=True))
            staged = torch.empty((len(slots), *self.host.shape[1:]), dtype=kv_cache.dtype,
                                 device=device)  # fmt: skip
            for row, slot, n in slot_runs(slots):
                staged[row : row + n].copy_(self.host[slot : slot + n], non_blocking=True)
            scatter_blocks(kv_cache, to_device(blocks, torch.int64, device), staged)


def slot_runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first row, first slot, length)`` of each run of consecutive slots in ``slots``."""
    runs: list[tuple[int, int, int]] = []
    for row, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first_row, first_slot, n = runs[-1]
            runs[-1] = (first_row, first_slot, n + 1)
        else:
            runs.append((row, slot, 1))
    return runs
