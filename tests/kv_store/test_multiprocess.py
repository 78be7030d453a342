"""Several processes (spawned, like prefill and decode instances) share one store under capacity
pressure. Every hit must hold exactly its key's payload; the capacity must hold throughout.
Payloads travel as chunks (put) and land in chunks (get); FileStore batches are split across its
worker threads."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from kv_store import FileStore, KVStore, RedisStore
from tests.conftest import RedisServer
from tests.kv_store import block_key, payload_for

FP = "mp-test|float16|bs16|L2|kv2|d64"
NUM_WORKERS = 4
DURATION_S = 2.0
BATCH = 8


class WorkerReport(NamedTuple):
    puts_ok: int
    hits: int
    misses: int
    corrupt: int  # hits whose bytes differ from the key's payload: must be 0
    over_capacity: int  # FileStore samples with committed bytes > capacity: must be 0


def size_of(key: str) -> int:
    """4 KiB .. 64 KiB, fixed per key, so readers know the exact payload size."""
    return 4096 * (1 + hashlib.sha256(key.encode()).digest()[0] % 16)


def _open(url_or_root: str, capacity: int | None) -> KVStore:
    if url_or_root.startswith("redis://"):
        return RedisStore(url_or_root, FP)
    store = FileStore(url_or_root, FP, capacity_bytes=capacity, workers=2)
    store._pool.min_item_bytes = store._pool.min_slice_bytes = 0  # split every batch
    return store


def _halves(size: int) -> tuple[int, int]:
    """Uneven chunk sizes of a payload, so chunk and file boundaries differ."""
    return size // 3, size - size // 3


def worker(url_or_root: str, capacity: int | None, num_keys: int, seed: int) -> WorkerReport:
    """Interleave batched puts and gets of random keys for DURATION_S seconds."""
    rng = random.Random(seed)
    keys = [block_key(FP, i) for i in range(num_keys)]
    puts_ok = hits = misses = corrupt = over = 0
    with _open(url_or_root, capacity) as store:
        deadline = time.monotonic() + DURATION_S
        while time.monotonic() < deadline:
            batch = rng.sample(keys, BATCH)
            payloads = [memoryview(payload_for(k, size_of(k))) for k in batch]
            chunked = [[p[: _halves(len(p))[0]], p[_halves(len(p))[0] :]] for p in payloads]
            puts_ok += sum(store.put_many(batch, chunked, [16] * BATCH))
            batch = rng.sample(keys, BATCH)
            out = [[memoryview(bytearray(n)) for n in _halves(size_of(k))] for k in batch]
            for key, hit, bufs in zip(batch, store.get_many_into(batch, [16] * BATCH, out), out):
                hits, misses = hits + hit, misses + (not hit)
                got = b"".join(buf.tobytes() for buf in bufs)
                corrupt += hit and got != payload_for(key, size_of(key))
            if capacity is not None:
                over += store.stats().bytes > capacity
    return WorkerReport(puts_ok, hits, misses, corrupt, over)


def _run_workers(url_or_root: str, capacity: int | None, num_keys: int) -> list[WorkerReport]:
    ctx = mp.get_context("spawn")
    with ctx.Pool(NUM_WORKERS) as pool:
        args = [(url_or_root, capacity, num_keys, seed) for seed in range(NUM_WORKERS)]
        reports = pool.starmap(worker, args)
    total = WorkerReport(*map(sum, zip(*reports)))
    assert total.corrupt == 0
    assert total.over_capacity == 0
    assert total.puts_ok > 0 and total.hits > 0 and total.misses > 0  # pressure was real
    return reports


def test_file_store_shared_by_processes(tmp_path: Path) -> None:
    capacity = 512 << 10  # ~15 entries of 4..64 KiB out of 100 keys: constant eviction
    root = tmp_path / "ns"
    FileStore(root, FP, capacity_bytes=capacity).close()  # create the index once, up front
    _run_workers(str(root), capacity, num_keys=100)

    with FileStore(root, FP, capacity_bytes=capacity) as store:
        stats = store.stats()
        assert 0 < stats.bytes <= capacity and stats.evictions > 0
        assert store.reconcile() == (0, 0)  # the index agrees with the directory
        files = [p for p in root.glob("??/*")]
        assert not [p for p in files if p.name.startswith(".tmp-")]
        assert sum(os.path.getsize(p) for p in files) == stats.bytes
        assert len(files) == stats.entries
        keys = [block_key(FP, i) for i in range(100)]
        for key, payload in zip(keys, store.get_many(keys, [16] * 100)):
            assert payload is None or payload == payload_for(key, size_of(key))


def test_redis_store_shared_by_processes(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(maxmemory="4mb", policy="allkeys-lru")
    _run_workers(server.url, None, num_keys=300)  # ~10 MiB of distinct entries

    with RedisStore(server.url, FP) as store:
        stats = store.stats()
        assert stats.evictions > 0
        assert stats.bytes <= 4 << 20
        keys = [block_key(FP, i) for i in range(300)]
        payloads = store.get_many(keys, [16] * 300)
        for key, payload in zip(keys, payloads):
            assert payload is None or payload == payload_for(key, size_of(key))
        # Not equal: a big GET pipeline's reply buffer counts against maxmemory and evicts more.
        assert 0 < sum(p is not None for p in payloads) <= stats.entries
