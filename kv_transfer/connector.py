"""``create_store_connector``: both halves of the KV connector over one store URL.

The scheduler half (``scheduler.py``) and the worker half (``worker.py``) each get their own
handle on the store, opened here for the layout's fingerprint (model identity, dtype, block size
and shape: never the tensor-parallel size, so pools of different TP sizes share entries).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

from common.kv_interface import KVCacheSpec
from common.parallel.block_exchange import BlockExchange
from kv_store.url import open_store
from kv_transfer.scheduler import StoreConnectorScheduler
from kv_transfer.worker import StoreConnectorWorker

ROLES = ("producer", "consumer", "both")


def kv_fingerprint(model_dir: Path, spec: KVCacheSpec) -> str:
    """Layout fingerprint: model identity (its config.json, and the weights' quantization when
    made at load) + the cache's dtype (an FP8 cache's scales too) + block size + shape."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    ident = json.dumps(config, sort_keys=True) + f"|{spec.dtype}|{spec.block_size}"
    ident += f"|{spec.num_layers}|{spec.num_kv_heads}|{spec.head_dim}"
    if spec.weight_quantization is not None:
        ident += f"|weights={spec.weight_quantization}"
    if any(scale != 1.0 for scale in spec.kv_scales):
        ident += f"|kv_scales={','.join(map(repr, spec.kv_scales))}"
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(model_dir).name)[:40]
    return f"{name}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def create_store_connector(
    url: str,
    role: str,
    model_dir: Path,
    spec: KVCacheSpec,
    device: torch.device,
    exchange: BlockExchange | None = None,
    *,
    read_in_place: bool | None = None,
) -> tuple[StoreConnectorScheduler, StoreConnectorWorker]:
    """Both halves of a store connector for ``url`` (``redis://…``, ``rediss://…``, ``file://…``,
    ``shm://…``).

    ``spec``: the store's layout (every KV head); ``exchange``: under tensor parallelism, how
    rank 0 reaches the other ranks' heads; ``read_in_place``: False stages a CPU engine's loads
    as CUDA stages them (the default reads straight into its cache; tests take the staged path
    on a CPU)."""
    if role not in ROLES:
        raise ValueError(f"kv_role must be one of {ROLES}, got {role!r}")
    fingerprint = kv_fingerprint(model_dir, spec)
    size = spec.bytes_per_block  # every entry of a fingerprint has it (a shm arena's slot)
    scheduler_store = open_store(url, fingerprint, payload_bytes=size)
    worker_store = open_store(url, fingerprint, payload_bytes=size)  # a handle per side
    sched = StoreConnectorScheduler(scheduler_store, fingerprint, spec.block_size, role, url)
    worker = StoreConnectorWorker(
        worker_store, spec, device, exchange=exchange, read_in_place=read_in_place
    )
    return sched, worker
