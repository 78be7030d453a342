"""The KV connector's types, below everything that uses them: what a store entry's layout is
(``KVCacheSpec``), what names a request's KV in a store (``KVHandle``), and what the scheduler
half hands the worker half each step (``ConnectorMetadata`` of ``LoadSpec`` and ``SaveSpec``;
``MatchedTokens`` is its answer to the scheduler's lookup). Plain data; the behaviour contract
is ``common/kv_connector.py``. Nothing here imports torch at run time (the router carries
handles, ``proto/pdserve_proto/convert.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import msgspec

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged cache; also the layout part of a KV store fingerprint."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    # the weights' quantization when the engine quantized them at load (their KV differs from
    # the checkpoint's: the fingerprint must tell them apart); None: as the checkpoint holds them
    weight_quantization: str | None = None
    # an FP8 cache's per-layer scales (k_0, v_0, k_1, …): entries hold K / k_scale, so another
    # set of scales reads the same bytes as other values; () or all ones: none
    kv_scales: tuple[float, ...] = ()

    @property
    def bytes_per_block(self) -> int:
        elem = self.dtype.itemsize
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem


class KVHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Names a request's prompt KV in a store: enough for any instance to load it.

    A ``msgspec.Struct``: engine-core messages carry it as it is."""

    fingerprint: str
    block_size: int
    num_tokens: int
    block_hashes: list[bytes]  # chained SHA-256 of each full prompt block
    store_url: str | None = None


@dataclass
class LoadSpec:
    """Blocks of one request to fill from the store (``block_ids[i]`` ← ``keys[i]``)."""

    request_id: str
    keys: list[str]
    block_ids: list[int]
    num_tokens: list[int]  # tokens held by each entry (block_size, or fewer for a final partial)


@dataclass
class SaveSpec:
    """Blocks of one request to write to the store after this step's forward pass.

    ``final``: the request's prompt completes this step (it samples its first token now), so
    ``wait_for_save`` returns only when every entry of its prompt is durable. Saves of earlier
    prompt chunks keep going in the background while later chunks compute."""

    request_id: str
    keys: list[str]
    block_ids: list[int]
    num_tokens: list[int]
    final: bool = False


@dataclass
class ConnectorMetadata:
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class MatchedTokens(NamedTuple):
    num_tokens: int | None  # extra prompt tokens the store holds beyond the local hit;
    # None: not known yet (the connector is asking the store off the scheduling path)
    load_async: bool  # True: load in the background; the request waits in its own state
