"""``StoreConnector``: the KV connector contract over a ``KVStore`` (Redis or shared files).

Entries are one block × all layers: the payload of block ``b`` is
``kv_cache[:, :, b]`` laid out as ``(num_layers, 2, block_size, num_kv_heads, head_dim)``, keyed by
the block's chained hash (``pdkv:{fingerprint}:{hash}``; a final partial prompt block adds its
token count). docs/BENCHMARKS.md ("KV transfer") has the measurement behind that granularity.

Save (producer): ``save_kv_layer`` copies the step's blocks of that layer into a host staging
buffer in one batched copy (on CUDA, device→host on a side stream, overlapped with the next
layers' compute); after the last layer a background writer puts the entries (skipping those the
store already holds) and ``wait_for_save`` returns when they are durable.

Load (consumer): one batched existence check decides how many prompt tokens to load; a
background reader fetches the entries into a host buffer while the engine keeps stepping other
requests; ``get_finished`` reports every block that did not arrive intact (missing, evicted,
corrupt, unreachable) as failed, so the scheduler recomputes from the first failed block, and the
next forward pass scatters the good ones into the paged cache layer by layer, each just before
its layer's attention. Output never changes, only speed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from common.block_hash import prompt_block_hashes
from common.kv_connector import (
    ConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVHandle,
    LoadSpec,
    MatchedTokens,
    SaveSpec,
)
from common.model_runner import KVCacheSpec
from common.request import Request
from common.scheduler import SchedulerOutput
from kv_store.base import KVStore
from kv_store.entry import make_key
from kv_store.url import open_store

logger = logging.getLogger(__name__)

ROLES = ("producer", "consumer", "both")


def kv_fingerprint(model_dir: Path, spec: KVCacheSpec) -> str:
    """Layout fingerprint: model identity (its config.json) + dtype + block size + shape."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    ident = json.dumps(config, sort_keys=True) + f"|{spec.dtype}|{spec.block_size}"
    ident += f"|{spec.num_layers}|{spec.num_kv_heads}|{spec.head_dim}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(model_dir).name)[:40]
    return f"{name}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def prompt_hashes(request: Request) -> list[bytes]:
    """Hashes of the request's prompt blocks (reusing the hashes it already carries)."""
    return prompt_block_hashes(
        request.prompt_token_ids, request.block_size, request.cache_salt, request.block_hashes
    )


def prompt_entries(request: Request, fingerprint: str) -> list[tuple[str, int]]:
    """(key, num_tokens) of the prompt's store entries: full blocks, then a final partial one."""
    n, bs = request.num_prompt_tokens, request.block_size
    out = []
    for i, block_hash in enumerate(prompt_hashes(request)):
        tokens = min(bs, n - i * bs)
        out.append((make_key(fingerprint, block_hash, None if tokens == bs else tokens), tokens))
    return out


class StoreConnectorScheduler(KVConnectorScheduler):
    def __init__(self, store: KVStore, fingerprint: str, block_size: int, role: str, url: str):
        self.store, self.fingerprint, self.block_size = store, fingerprint, block_size
        self.role, self.url = role, url
        self._loads: list[LoadSpec] = []
        self._saved: dict[str, int] = {}  # request id → prompt entries already saved

    @property
    def loads(self) -> bool:
        return self.role in ("consumer", "both")

    @property
    def saves(self) -> bool:
        return self.role in ("producer", "both")

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if not self.loads:
            return MatchedTokens(0, False)
        candidates = self._candidates(request, num_computed_tokens)
        if not candidates:
            return MatchedTokens(0, False)
        present = self.store.contains_many([key for key, _ in candidates])
        matched = 0
        for (_, n), ok in zip(candidates, present):
            if not ok:
                break
            matched += n
        return MatchedTokens(matched, True)

    def _candidates(self, request: Request, num_computed: int) -> list[tuple[str, int]]:
        """Entries after the local hit whose tokens still leave one token to compute."""
        entries = prompt_entries(request, self.fingerprint)
        entries = entries[num_computed // self.block_size :]
        budget = request.num_tokens - 1 - num_computed
        out = []
        for key, n in entries:
            if n > budget:
                break
            out.append((key, n))
            budget -= n
        return out

    def update_state_after_alloc(self, request, block_ids, num_external_tokens) -> None:
        first = request.num_computed_tokens // self.block_size
        entries, total = [], 0
        for key, n in self._candidates(request, request.num_computed_tokens):
            if total >= num_external_tokens:
                break
            entries.append((key, n))
            total += n
        ids = block_ids[first : first + len(entries)]
        self._loads.append(
            LoadSpec(request.request_id, [k for k, _ in entries], ids, [n for _, n in entries])
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        meta = ConnectorMetadata(loads=self._loads)
        self._loads = []
        if self.saves:
            for item in scheduler_output.scheduled:
                spec = self._save_spec(item.request, item.num_new_tokens, item.block_ids)
                if spec is not None:
                    meta.saves.append(spec)
        return meta

    def _save_spec(self, request: Request, num_new: int, block_ids: list[int]) -> SaveSpec | None:
        """Prompt entries whose tokens are all computed once this step's forward pass is done."""
        done = min(request.num_computed_tokens + num_new, request.num_prompt_tokens)
        start = self._saved.get(request.request_id, 0)
        ready = done // self.block_size
        if done == request.num_prompt_tokens:
            ready = -(-done // self.block_size)  # the final partial block is complete too
        if ready <= start:
            return None  # every step of a decoding request ends here, before any hashing
        self._saved[request.request_id] = ready
        chosen = prompt_entries(request, self.fingerprint)[start:ready]
        return SaveSpec(
            request.request_id,
            [k for k, _ in chosen],
            block_ids[start:ready],
            [n for _, n in chosen],
        )

    def request_finished(self, request: Request, block_ids: list[int]):
        self._saved.pop(request.request_id, None)
        if not self.saves:
            return False, None
        handle = KVHandle(
            self.fingerprint,
            self.block_size,
            request.num_prompt_tokens,
            prompt_hashes(request),
            self.url,
        )
        return False, handle  # blocks are copied out during the step: nothing to hold


class StoreConnectorWorker(KVConnectorWorker):
    def __init__(self, store: KVStore, spec: KVCacheSpec, device: torch.device) -> None:
        self.store, self.spec, self.device = store, spec, device
        self._meta = ConnectorMetadata()
        self._kv_cache: torch.Tensor | None = None
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-writer")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-reader")
        self._loading: dict[str, tuple[LoadSpec, Future]] = {}
        self._failed: set[int] = set()
        self._done_saving: set[str] = set()
        # (request id, block ids, host buffer (n, L, 2, bs, Hkv, D)) fetched and verified,
        # scattered layer by layer by the next forward pass
        self._landed: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        self._staging: torch.Tensor | None = None
        self._save_ids: torch.Tensor | None = None
        self.num_saved_blocks = self.num_loaded_blocks = self.num_failed_blocks = 0

    # -- per step ------------------------------------------------------------------------------
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._meta = meta
        ids = [b for s in meta.saves for b in s.block_ids]
        self._save_ids = torch.tensor(ids, device=self.device) if ids else None
        if ids:
            shape = (
                len(ids),
                self.spec.num_layers,
                2,
                self.spec.block_size,
                self.spec.num_kv_heads,
                self.spec.head_dim,
            )
            pin = self.device.type == "cuda"
            self._staging = torch.empty(shape, dtype=self.spec.dtype, pin_memory=pin)

    def clear_connector_metadata(self) -> None:
        self._meta = ConnectorMetadata()
        self._save_ids = None

    # -- load path -----------------------------------------------------------------------------
    def start_load_kv(self, kv_cache: torch.Tensor) -> None:
        """Start this step's fetches in the background (the request stays parked meanwhile)."""
        self._kv_cache = kv_cache
        for spec in self._meta.loads:
            self._loading[spec.request_id] = (spec, self._reader.submit(self._fetch, spec))

    def _fetch(self, spec: LoadSpec) -> tuple[torch.Tensor, list[bool]]:
        """Reader thread: entries → one host buffer ``(n, L, 2, bs, Hkv, D)``; never raises."""
        buf = torch.empty((len(spec.keys), *self._entry_shape()), dtype=self.spec.dtype)
        views = _entry_views(buf)
        try:
            ok = self.store.get_many_into(spec.keys, spec.num_tokens, views)
        except Exception:  # a store bug must cost a recompute, never a wrong token
            logger.exception("KV load failed for %s", spec.request_id)
            ok = [False] * len(spec.keys)
        return buf, ok

    def wait_for_layer_load(self, layer: int) -> None:
        """Scatter layer ``layer`` of every landed load into the paged cache, just before that
        layer's attention: layer 0 computes while later layers are still in host memory (on
        CUDA the host→device copy of layer l+1 overlaps layer l's compute).

        Landed blocks are fully scattered within the first forward pass after they land, and
        that pass is the first that can read them (a prefix hit on them included)."""
        if self._kv_cache is None or not self._landed:
            return
        for _, ids, src in self._landed:
            self._kv_cache[layer, :, ids] = (
                src[:, layer].to(self.device, non_blocking=True).transpose(0, 1)
            )
        if layer == self.spec.num_layers - 1:
            self._landed = []

    def get_finished(self, request_ids: set[str]) -> tuple[set[str], set[str]]:
        """``request_ids``: requests the scheduler ended since the last call (their loads are
        dropped, never scattered into blocks that may already be reused)."""
        for request_id in request_ids:
            self._loading.pop(request_id, None)
        self._landed = [entry for entry in self._landed if entry[0] not in request_ids]
        done_loading = {rid for rid, (_, fut) in self._loading.items() if fut.done()}
        for request_id in done_loading:
            spec, fut = self._loading.pop(request_id)
            self._land(spec, *fut.result())
        done_saving, self._done_saving = self._done_saving, set()
        return done_saving, done_loading

    def _land(self, spec: LoadSpec, buf: torch.Tensor, ok: list[bool]) -> None:
        """A verified fetch: failures are reported now, good blocks wait for the next forward."""
        good = [i for i, hit in enumerate(ok) if hit]
        self._failed.update(b for b, hit in zip(spec.block_ids, ok) if not hit)
        self.num_loaded_blocks += len(good)
        self.num_failed_blocks += len(ok) - len(good)
        if good:
            ids = torch.tensor([spec.block_ids[i] for i in good], device=self.device)
            self._landed.append((spec.request_id, ids, buf[good]))

    def get_failed_blocks(self) -> set[int]:
        failed, self._failed = self._failed, set()
        return failed

    # -- save path -----------------------------------------------------------------------------
    def save_kv_layer(self, layer: int, kv_layer: torch.Tensor) -> None:
        if self._save_ids is None or self._staging is None:
            return
        # (2, n, bs, Hkv, D) → (n, 2, bs, Hkv, D): one batched gather per layer
        blocks = kv_layer.index_select(1, self._save_ids).transpose(0, 1)
        self._staging[:, layer].copy_(blocks, non_blocking=True)

    def wait_for_save(self) -> None:
        if self._save_ids is None or self._staging is None:
            return
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        saves, staging = self._meta.saves, self._staging
        self._writer.submit(self._write, saves, staging).result()
        self._done_saving.update(s.request_id for s in saves)

    def _write(self, saves: list[SaveSpec], staging: torch.Tensor) -> None:
        keys = [k for s in saves for k in s.keys]
        tokens = [n for s in saves for n in s.num_tokens]
        views = _entry_views(staging)
        try:
            present = self.store.contains_many(keys)
            todo = [i for i, p in enumerate(present) if not p]
            ok = self.store.put_many(
                [keys[i] for i in todo], [views[i] for i in todo], [tokens[i] for i in todo]
            )
            self.num_saved_blocks += sum(ok)
            if not all(ok):
                logger.warning("%d of %d KV entries not saved", len(ok) - sum(ok), len(ok))
        except Exception:  # a lost save only costs the consumer a recompute
            logger.exception("KV save failed")

    def _entry_shape(self) -> tuple[int, ...]:
        s = self.spec
        return (s.num_layers, 2, s.block_size, s.num_kv_heads, s.head_dim)

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self.store.close()


def _entry_views(buf: torch.Tensor) -> list[memoryview]:
    """One writable byte view per entry of a contiguous ``(n, ...)`` host buffer."""
    raw = buf.view(torch.uint8).numpy().reshape(buf.shape[0], -1)
    return [memoryview(raw[i]) for i in range(buf.shape[0])]


def create_store_connector(
    url: str, role: str, model_dir: Path, spec: KVCacheSpec, device: torch.device
) -> tuple[StoreConnectorScheduler, StoreConnectorWorker]:
    """Both halves of a store connector for ``url`` (``redis://…``, ``rediss://…``, ``file://…``)."""
    if role not in ROLES:
        raise ValueError(f"kv_role must be one of {ROLES}, got {role!r}")
    fingerprint = kv_fingerprint(model_dir, spec)
    scheduler_store = open_store(url, fingerprint)
    worker_store = open_store(url, fingerprint)  # each thread pair gets its own handle
    sched = StoreConnectorScheduler(scheduler_store, fingerprint, spec.block_size, role, url)
    return sched, StoreConnectorWorker(worker_store, spec, device)
