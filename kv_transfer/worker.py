"""The worker half of the store connector: binds each step's specs to one ``Saver`` and one
``Loader``, chosen once, when it is built, for where the cache lives.

```
                     saves (producer)                      loads (consumer)
CPU                  CopySaver      (saver.py)             InPlaceLoader  (loader.py)
CPU, staged (tests)  CopySaver                             StagedLoader   (staged_loader.py)
CUDA                 StreamSaver:   D2H on a save stream   StreamLoader:  H2D on a load stream
tensor parallel      ExchangeSaver: collect after a step   ExchangeLoader: land between steps
```

Save: the step's blocks are staged as each layer computes (``save_kv_layer``) and written by a
background writer; ``wait_for_save`` returns once the prompts that complete in this step are
durable. Load: a background reader fetches the entries while the engine keeps stepping other
requests; ``get_finished`` reports every block that did not arrive intact as failed, so the
scheduler recomputes from the first failed block. Output never changes, only speed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from common.kv_connector import KVConnectorWorker
from common.kv_interface import ConnectorMetadata, KVCacheSpec
from common.parallel.block_exchange import BlockExchange
from kv_store.base import KVStore
from kv_transfer.loader import InPlaceLoader, Loader
from kv_transfer.saver import CopySaver, ExchangeSaver, Saver, StreamSaver
from kv_transfer.staged_loader import ExchangeLoader, StagedLoader, StreamLoader
from kv_transfer.staging import StagingRing

STAGING_SLOTS = 4  # per direction
STAGING_SLOT_BYTES = 64 * 2**20  # rounded down to whole entries (at least one)


class StoreConnectorWorker(KVConnectorWorker):
    """The byte-moving half: this step's metadata, handed to its saver and its loader."""

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
        """``read_in_place``: a CPU cache is read into directly (the default there); False
        stages its loads as CUDA does. ``exchange``: this is rank 0 of a tensor-parallel group,
        whose cache holds only its KV heads; whole blocks (``spec``: every head, the store's
        layout) move between staging and every rank's heads through it, between steps
        (``common/parallel/block_exchange.py``), never layer by layer."""
        self.store, self.spec, self.device = store, spec, device
        per_slot = max(1, slot_bytes // spec.bytes_per_block)
        placement = _placement(
            store, spec, device, staging_slots, per_slot, read_in_place, exchange
        )
        self.saver, self.loader = placement
        self._meta = ConnectorMetadata()

    # -- per step ------------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._meta = meta
        self.saver.bind(meta.saves)

    def clear_connector_metadata(self) -> None:
        self._meta = ConnectorMetadata()
        self.saver.clear()

    def start_load_kv(self, kv_cache: torch.Tensor) -> None:
        self.loader.start(self._meta.loads, kv_cache)

    def layer_work_pending(self) -> bool:
        return self.saver.layer_work_pending() or self.loader.layer_work_pending()

    def wait_for_layer_load(self, layer: int) -> None:
        self.loader.wait_for_layer(layer)

    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        self.saver.save_layer(layer, kv_layer)

    def wait_for_save(self) -> None:
        self.saver.flush(self._meta.saves)

    # -- between steps -------------------------------------------------------------------------
    def get_finished(self, request_ids: set[str]) -> tuple[set[str], set[str]]:
        """``request_ids``: requests the scheduler ended since the last call (their loads are
        dropped, never written into blocks that may already be reused)."""
        return self.saver.finished(request_ids), self.loader.finished(request_ids)

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        self.loader.wake = wake

    def get_failed_blocks(self) -> set[int]:
        return self.loader.take_failed()

    @property
    def num_saved_blocks(self) -> int:
        return self.saver.num_saved_blocks

    @property
    def num_loaded_blocks(self) -> int:
        return self.loader.num_loaded_blocks

    @property
    def num_failed_blocks(self) -> int:
        return self.loader.num_failed_blocks

    def close(self) -> None:
        """Stop the threads and give the staging memory back; idempotent. Queued saves are
        written first; loads in flight are dropped (a reader waiting for a slot gives up)."""
        self.loader.close()
        self.saver.close()
        self.store.close()


def _placement(
    store: KVStore,
    spec: KVCacheSpec,
    device: torch.device,
    slots: int,
    per_slot: int,
    read_in_place: bool | None,
    exchange: BlockExchange | None,
) -> tuple[Saver, Loader]:
    """The saver and loader for where the cache lives, each with its own staging ring of
    ``slots`` slots of ``per_slot`` entries (pinned on CUDA)."""
    on_cuda = device.type == "cuda"
    if read_in_place is None:
        read_in_place = not on_cuda and exchange is None
    if read_in_place and (on_cuda or exchange is not None):
        raise ValueError("a CUDA or tensor-parallel cache cannot be read into in place")

    def ring() -> StagingRing:
        return StagingRing(slots, per_slot * spec.bytes_per_block, pin=on_cuda)

    if exchange is not None:
        return (
            ExchangeSaver(store, spec, device, ring(), exchange),
            ExchangeLoader(store, spec, device, ring(), exchange),
        )
    if on_cuda:
        return StreamSaver(store, spec, device, ring()), StreamLoader(store, spec, device, ring())
    if read_in_place:
        return CopySaver(store, spec, device, ring()), InPlaceLoader(store, spec, device, per_slot)
    return CopySaver(store, spec, device, ring()), StagedLoader(store, spec, device, ring())
