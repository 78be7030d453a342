"""KV transfer throughput: put/get GB/s of the arena, file and Redis stores beside raw baselines.

    python benchmarks/kv_transfer.py            # full run (~3-4 min on 2 cores)
    python benchmarks/kv_transfer.py --quick    # a few seconds
    python benchmarks/kv_transfer.py --stores arena file --workers 8
    python -m benchmarks.kv_transfer --stores arena arena-locked --granularities block chunks

For each store, layout and granularity, the same bytes go through the store and through the
plain baseline in the same run:
  - ArenaStore and FileStore (each with `--workers` I/O threads, default min(8, cpu count)) vs
    raw files: each entry to its own file (open, one pwritev of its chunks, close), read back with
    open + one preadv into its buffers, in a sibling directory on the same filesystem, by 1 and by
    `--workers` threads (each batch split into contiguous slices); the better of the two counts;
  - RedisStore vs raw redis-py: SET/GET of the bare payloads, pipelined per batch the same way.
Store "arena" is the ArenaStore as processes get it (lock-free reads through its C slot
protocol); "arena-locked" the same store with every read batch under the arena lock, as a
machine with no C compiler runs it.
Granularity "block" stores one entry per block holding every layer, from a block-major buffer;
"chunks" stores the same entries from a layer-major staging buffer, each entry's payload given
as its L per-layer slices (what the connector hands the store) and read back into L slices;
"layer" stores one entry per block per layer (layer-wise pipelining: one put_many per layer).
Throughput counts payload bytes (1 GB = 1e9 B); each figure is the best of --repeat runs. Buffers
start 64 bytes into a page, as torch's CPU allocator places them (on AMD Zen, glibc's memcpy is
~3x slower when destination - source is a few bytes past a multiple of 4 KiB: numpy's 16-byte
offset would hit that on some reads and not others). Starts its own redis-server on a free port.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_store import ArenaStore, FileStore, KVStore, RedisStore, make_key
from kv_store.arena_store import arena_path
from kv_store.file_store import default_workers


@dataclass(frozen=True)
class Layout:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def layer_bytes(self) -> int:
        """K and V of one block of one layer."""
        return 2 * self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes


LAYOUTS = [
    Layout("tiny-llama fp32", layers=4, kv_heads=2, head_dim=32, block_size=16, dtype_bytes=4),
    Layout("32KiB/token fp32", layers=8, kv_heads=8, head_dim=64, block_size=16, dtype_bytes=4),
    Layout("llama-3-8b bf16", layers=32, kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2),
]
GRANULARITIES = ("block", "chunks", "layer")
BLOCKS_PER_BATCH = 32  # one 512-token prompt per put_many / get_many
Entry = memoryview | list[memoryview]


@dataclass(frozen=True)
class Workload:
    """`batches` of equal-sized entries; each batch is one put_many / get_many call."""

    batches: list[list[str]]
    entry_bytes: int
    sources: list[list[Entry]]  # per batch, the payload of each entry (a buffer or its chunks)
    outs: list[list[Entry]]  # per batch, a preallocated destination per entry

    @property
    def total_bytes(self) -> int:
        return sum(len(b) for b in self.batches) * self.entry_bytes

    @property
    def num_entries(self) -> int:
        return sum(len(b) for b in self.batches)


def aligned(nbytes: int, offset: int = 64) -> np.ndarray:
    """A zeroed uint8 array starting `offset` bytes into a page, every page faulted in (np.zeros
    alone would map lazily zeroed pages, and the first timed copy would pay the faults)."""
    raw = np.empty(nbytes + 2 * 4096, np.uint8)
    raw.fill(0)
    start = (offset - raw.ctypes.data) % 4096
    return raw[start : start + nbytes]


def make_workload(layout: Layout, granularity: str, total_bytes: int) -> Workload:
    """Split `total_bytes` of random KV data into blocks (and layers) as the connector would."""
    n_blocks = max(BLOCKS_PER_BATCH, total_bytes // layout.block_bytes)
    n_blocks -= n_blocks % BLOCKS_PER_BATCH
    data = aligned(n_blocks * layout.block_bytes)
    data[:] = np.random.default_rng(0).integers(0, 256, data.size, np.uint8)
    out = aligned(data.size)
    if granularity == "chunks":  # layer-major (L, blocks, layer bytes), as a staging buffer
        src = data.reshape(layout.layers, n_blocks, layout.layer_bytes)
        dst = out.reshape(layout.layers, n_blocks, layout.layer_bytes)
    else:  # block-major (blocks, L, layer bytes)
        src = data.reshape(n_blocks, layout.layers, layout.layer_bytes)
        dst = out.reshape(n_blocks, layout.layers, layout.layer_bytes)
    per_layer = granularity == "layer"

    def entry(buf: np.ndarray, block: int, layer: int | None) -> Entry:
        if granularity == "chunks":
            return [memoryview(buf[layer_, block]) for layer_ in range(layout.layers)]
        return memoryview(buf[block, layer] if layer is not None else buf[block].reshape(-1))

    batches, sources, outs = [], [], []
    for first in range(0, n_blocks, BLOCKS_PER_BATCH):
        for layer in range(layout.layers) if per_layer else [None]:
            blocks = range(first, first + BLOCKS_PER_BATCH)
            batches.append([make_key(layout.name, b.to_bytes(8, "little"), layer) for b in blocks])
            sources.append([entry(src, b, layer) for b in blocks])
            outs.append([entry(dst, b, layer) for b in blocks])
    size = layout.layer_bytes if per_layer else layout.block_bytes
    return Workload(batches, size, sources, outs)


class Phases(NamedTuple):
    """One side of a comparison: `reset()` empties it, then `put()` and `get()` move every byte."""

    reset: Callable[[], None]
    put: Callable[[], None]
    get: Callable[[], None]


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(store: Phases, raws: Sequence[Phases], repeat: int) -> tuple[float, ...]:
    """Best (store put, store get, raw put, raw get) seconds over `repeat` rounds; raw is the
    fastest of `raws`. All sides alternate inside each round so they see the same load."""
    best = [float("inf")] * (2 + 2 * len(raws))
    sides = [*((raw, 2 + 2 * i) for i, raw in enumerate(raws)), (store, 0)]
    for _ in range(repeat):
        for side, offset in sides:
            side.reset()
            best[offset] = min(best[offset], _timed(side.put))
        for side, offset in sides:
            best[offset + 1] = min(best[offset + 1], _timed(side.get))
    return best[0], best[1], min(best[2::2]), min(best[3::2])


def store_phases(store: KVStore, w: Workload) -> Phases:
    """The store's batched API: one put_many / get_many_into per batch."""
    tokens = [16] * BLOCKS_PER_BATCH

    def put() -> None:
        for keys, src in zip(w.batches, w.sources):
            assert all(store.put_many(keys, src, tokens))

    def get() -> None:
        for keys, out in zip(w.batches, w.outs):
            assert all(store.get_many_into(keys, tokens, out))

    def reset() -> None:
        store.clear()

    return Phases(reset, put, get)


def raw_file_phases(
    root: Path, w: Workload, pool: ThreadPoolExecutor | None, threads: int = 1
) -> Phases:
    """Each entry to its own file (open, pwritev, close), read back with open + preadv; each
    batch split into `threads` contiguous slices run on `pool` (None: the calling thread)."""
    paths = [[str(root / f"{i}-{j}") for j in range(len(b))] for i, b in enumerate(w.batches)]

    def write(path: str, payload: Entry) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.pwritev(fd, payload if isinstance(payload, list) else [payload], 0)
        os.close(fd)

    def read(path: str, buf: Entry) -> None:
        fd = os.open(path, os.O_RDONLY)
        os.preadv(fd, buf if isinstance(buf, list) else [buf], 0)
        os.close(fd)

    def run(fn: Callable[[str, Entry], None], batch_paths: list[str], bufs: list[Entry]) -> None:
        if pool is None:
            for path, buf in zip(batch_paths, bufs):
                fn(path, buf)
            return
        bounds = [len(batch_paths) * s // threads for s in range(threads + 1)]
        slices = [(batch_paths[a:b], bufs[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
        for future in [pool.submit(lambda s: list(map(fn, *s)), s) for s in slices]:
            future.result()

    def reset() -> None:  # like the store's clear(): every put creates fresh files
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)

    def put() -> None:
        for batch_paths, src in zip(paths, w.sources):
            run(write, batch_paths, src)

    def get() -> None:
        for batch_paths, out in zip(paths, w.outs):
            run(read, batch_paths, out)

    return Phases(reset, put, get)


def raw_redis_phases(client: redis.Redis, w: Workload) -> Phases:
    """Plain redis-py: pipelined SET/GET of the bare payloads under `raw:` keys."""
    batches = [["raw:" + key for key in keys] for keys in w.batches]

    def reset() -> None:
        for keys in batches:
            client.unlink(*keys)

    def put() -> None:
        for keys, src in zip(batches, w.sources):
            pipe = client.pipeline(transaction=False)
            for key, payload in zip(keys, src):
                pipe.set(key, payload)
            pipe.execute()

    def get() -> None:
        for keys in batches:
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            pipe.execute()  # bytes as redis-py returns them: no copy into `out` (stricter)

    return Phases(reset, put, get)


@contextlib.contextmanager
def redis_server(binary: str) -> Iterator[str]:
    """A private, non-persistent redis-server on a free port; yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as workdir:
        cmd = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        cmd += ["--appendonly", "no", "--dir", workdir]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            _wait_for(url)
            yield url
        finally:
            proc.kill()
            proc.wait()


def _wait_for(url: str) -> None:
    client = redis.Redis.from_url(url)
    for _ in range(500):
        try:
            client.ping()
            return
        except redis.ConnectionError:
            time.sleep(0.01)
    raise RuntimeError(f"redis-server at {url} did not start")


def run(args: argparse.Namespace) -> list[tuple[str, ...]]:
    rows = []
    total = (32 if args.quick else args.total_mib) << 20
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_server(args.redis_server)) if "redis" in args.stores else ""
        pool = stack.enter_context(ThreadPoolExecutor(args.workers)) if args.workers > 1 else None
        for layout in LAYOUTS:
            for granularity in args.granularities:
                w = make_workload(layout, granularity, total)
                for name in args.stores:
                    if name == "redis" and granularity == "chunks":
                        continue  # raw redis-py takes one buffer per value
                    rows.append(_row(name, layout, granularity, w, url, pool, args))
                    print(" | ".join(rows[-1]), file=sys.stderr)
    return rows


def _row(
    name: str,
    layout: Layout,
    granularity: str,
    w: Workload,
    url: str,
    pool: ThreadPoolExecutor | None,
    args: argparse.Namespace,
) -> tuple[str, ...]:
    root = Path(args.dir)
    raws: list[Phases]
    if name.startswith("arena"):  # a fresh arena per row: each workload has its own entry size
        path = arena_path(layout.name, root / "arena")
        path.unlink(missing_ok=True)
        capacity = (w.num_entries + w.num_entries // 4) * (64 + w.entry_bytes + 64)
        store: KVStore = ArenaStore(
            path, layout.name, payload_bytes=w.entry_bytes, capacity_bytes=capacity,
            workers=args.workers, locked_reads=name == "arena-locked",
        )  # fmt: skip
    elif name == "file":
        capacity = 4 * w.total_bytes
        store = FileStore(
            root / "store", layout.name, capacity_bytes=capacity, workers=args.workers
        )
    else:
        store = RedisStore(url, layout.name)
        raws = [raw_redis_phases(redis.Redis.from_url(url), w)]
    if name != "redis":
        raws = [raw_file_phases(root / "raw", w, None)]
        if pool is not None:
            raws.append(raw_file_phases(root / "raw", w, pool, args.workers))
    with store:
        seconds = measure(store_phases(store, w), raws, args.repeat)
        store.clear()
        raws[0].reset()
    gbps = [w.total_bytes / s / 1e9 for s in seconds]
    cells = [f"{x:.2f}" for x in gbps] + [f"{gbps[0] / gbps[2]:.0%}", f"{gbps[1] / gbps[3]:.0%}"]
    workers = "-" if name == "redis" else str(args.workers)
    return (name, layout.name, granularity, _kib(w.entry_bytes), workers, *cells)


def _kib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


HEADER = ("store", "layout", "granularity", "entry", "workers", "put GB/s", "get GB/s")
HEADER += ("raw put", "raw get", "put ratio", "get ratio")


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def arena_vs_file(rows: list[tuple[str, ...]]) -> str:
    """Arena ÷ file, put and get, per layout and granularity (rows of both stores needed)."""
    by_case = {(r[0], r[1], r[2]): r for r in rows}
    lines = ["| layout | granularity | entry | arena/file put | arena/file get |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for (store, layout, granularity), arena in by_case.items():
        file = by_case.get(("file", layout, granularity))
        if store != "arena" or file is None:
            continue
        put, get = (float(arena[i]) / float(file[i]) for i in (5, 6))
        lines.append(f"| {layout} | {granularity} | {arena[3]} | {put:.1f}x | {get:.1f}x |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB per case, one repetition")
    parser.add_argument("--total-mib", type=int, default=256, help="data per case (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per figure")
    parser.add_argument("--dir", default="/dev/shm/pdserve-bench", help="store + raw dir")
    parser.add_argument(
        "--stores", nargs="+", default=["arena", "file", "redis"],
        choices=["arena", "arena-locked", "file", "redis"],
    )  # fmt: skip
    parser.add_argument("--granularities", nargs="+", default=list(GRANULARITIES))
    parser.add_argument("--workers", type=int, default=default_workers(), help="I/O threads")
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 1
    try:
        rows = run(args)
        print(markdown_table(rows))
        print(arena_vs_file(rows))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
