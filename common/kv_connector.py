"""The KV connector contract: how an engine saves KV blocks to, and loads them from, elsewhere.

Two halves joined by a per-step metadata object (vLLM V1's shape, kept small). The scheduler half
runs inside ``Scheduler.schedule`` and only decides; the worker half runs inside the model runner
and moves bytes. ``common/`` knows only this contract (its types are ``common/kv_interface.py``);
``kv_transfer/`` implements it over the byte stores of ``kv_store/``.

Step by step:

0. ``check_handle`` (when a request arrives with a KV handle, e.g. on a decode node): is it a
   handle of this prompt in this connector's layout? The handle is then the contract: its entries
   are what the connector loads, without asking the store whether they exist (a missing one is a
   failed block, recomputed).
1. ``get_num_new_matched_tokens`` (after the local prefix lookup): how many more prompt tokens
   the external store holds. No side effects on the scheduler; it never waits for the store: a
   connector that must ask (a request without a handle) asks off the scheduling path and answers
   ``None`` ("not known yet") until the answer is in, and the scheduler tries again next step.
2. The scheduler allocates blocks for them and calls ``update_state_after_alloc``; with
   ``load_async`` the request waits in ``WAITING_FOR_REMOTE_KV`` without holding up others.
3. ``build_connector_meta`` packs this step's loads and saves; the runner binds it, calls
   ``start_load_kv`` before the forward pass, ``wait_for_layer_load`` / ``save_kv_layer`` around
   each layer's attention, and ``wait_for_save`` once the step's sampling is launched (before
   the runner returns the step's tokens).
4. ``get_finished`` reports finished loads and saves; ``get_failed_blocks`` the blocks that
   could not be loaded (missing, evicted, corrupt, unreachable): the scheduler recomputes from the first one.
   The store connector reports both before any compute uses the blocks, and its next forward
   pass moves the landed blocks into the paged cache layer by layer (``wait_for_layer_load``).
5. ``request_finished`` returns the request's KV handle (what a decode node needs to load it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from common.kv_interface import ConnectorMetadata, KVCacheSpec, KVHandle, MatchedTokens
from common.request import Request
from common.step_outputs import SchedulerOutput

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from common.parallel.block_exchange import BlockExchange

    class ConnectorFactory(Protocol):
        """How an engine is handed its connector (``kv_transfer.connector.create_store_connector``
        is one); picklable, so an engine-core process can be spawned with it. ``spec``: the
        store's layout (every KV head); ``exchange``: rank 0's way to the other tensor-parallel
        ranks' heads, None on one device."""

        def __call__(
            self,
            url: str,
            role: str,
            model_dir: Path,
            spec: KVCacheSpec,
            device: torch.device,
            exchange: BlockExchange | None = None,
        ) -> tuple[KVConnectorScheduler, KVConnectorWorker]: ...


class KVConnectorScheduler(ABC):
    """Scheduler half: decides what to load and save; touches no tensors, never waits for I/O."""

    fingerprint: str  # the layout a handle must name to be loadable here

    @abstractmethod
    def check_handle(self, request: Request, handle: KVHandle) -> None:
        """Raise ValueError unless ``handle`` names ``request``'s prompt in this layout."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> MatchedTokens: ...

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None: ...

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata: ...

    @abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, KVHandle | None]:
        """(delay_free, kv_handle): delay_free asks the scheduler to keep the blocks for now."""

    @abstractmethod
    def close(self) -> None:
        """Stop background work (store lookups) and release the store."""

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (from any thread) when a store lookup answers: an engine with
        nothing else to run waits for it instead of polling. A connector whose answers never
        come from another thread keeps this default."""
        return None


class KVConnectorWorker(ABC):
    """Worker half: moves bytes between the paged cache and the store."""

    @abstractmethod
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None: ...

    @abstractmethod
    def clear_connector_metadata(self) -> None: ...

    @abstractmethod
    def start_load_kv(self, kv_cache: torch.Tensor) -> None: ...

    @abstractmethod
    def wait_for_layer_load(self, layer: int) -> None: ...

    @abstractmethod
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None: ...

    @abstractmethod
    def layer_work_pending(self) -> bool:
        """Whether this step's forward pass must call the per-layer hooks (blocks to land or
        to save); a step without such work may run as a captured graph."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Return only when every block of the prompts completing this step (``SaveSpec.final``)
        is durable in the store (or failed for good, which only costs a later recompute). Called
        after the step's forward pass and sampling are launched; its tokens are returned after."""

    @abstractmethod
    def get_finished(self, request_ids: set[str]) -> tuple[set[str], set[str]]:
        """(done_saving, done_loading) since the last call."""

    @abstractmethod
    def get_failed_blocks(self) -> set[int]:
        """Block ids whose load failed since the last call."""

    @abstractmethod
    def close(self) -> None:
        """Stop background threads and release the store."""

    def set_wakeup(self, wake: Callable[[], None]) -> None:
        """``wake`` is called (from any thread) when a part of a load arrives (see
        ``KVConnectorScheduler.set_wakeup``)."""
        return None


class ConnectorHooks:
    """Adapts a worker connector to the model's per-layer hooks (``common.attention.LayerHooks``)."""

    def __init__(self, worker: KVConnectorWorker) -> None:
        self.worker = worker

    def before_layer(self, layer: int) -> None:
        self.worker.wait_for_layer_load(layer)

    def after_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        self.worker.save_kv_layer(layer, kv_layer)
