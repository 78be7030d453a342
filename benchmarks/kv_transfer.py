"""KV transfer throughput: put/get GB/s of FileStore and RedisStore beside raw baselines.

    python benchmarks/kv_transfer.py            # full run (~1-2 min on 2 cores)
    python benchmarks/kv_transfer.py --quick    # a few seconds

For each store, layout and granularity, the same bytes go through the store and through the
plain baseline in the same run:
  - FileStore vs raw files: open/write/close each entry, then open/readinto a preallocated buffer,
    in a sibling directory on the same filesystem;
  - RedisStore vs raw redis-py: SET/GET of the bare payloads, pipelined per batch the same way.
Granularity "block" stores one entry per block holding every layer (what `save_kv_layer` batches
at the end of a prefill); "layer" stores one entry per block per layer (what layer-wise
pipelining would write: one put_many per layer). Throughput counts payload bytes (1 GB = 1e9 B);
each figure is the best of --repeat runs. Starts its own redis-server on a free port.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kv_store import FileStore, KVStore, RedisStore, make_key


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
    Layout("llama-3-8b bf16", layers=32, kv_heads=8, head_dim=128, block_size=16, dtype_bytes=2),
]
BLOCKS_PER_BATCH = 32  # one 512-token prompt per put_many / get_many


@dataclass(frozen=True)
class Workload:
    """`batches` of equal-sized entries; each batch is one put_many / get_many call."""

    batches: list[list[str]]
    entry_bytes: int
    sources: list[list[memoryview]]  # per batch, the payload of each entry
    outs: list[list[memoryview]]  # per batch, a preallocated destination per entry

    @property
    def total_bytes(self) -> int:
        return sum(len(b) for b in self.batches) * self.entry_bytes


def make_workload(layout: Layout, granularity: str, total_bytes: int) -> Workload:
    """Split `total_bytes` of random KV data into blocks (and layers) as the connector would."""
    n_blocks = max(BLOCKS_PER_BATCH, total_bytes // layout.block_bytes)
    n_blocks -= n_blocks % BLOCKS_PER_BATCH
    data = np.random.default_rng(0).integers(0, 256, n_blocks * layout.block_bytes, np.uint8)
    out = np.zeros_like(data)  # zeros, not empty: fault the pages in before anything is timed
    per_layer = granularity == "layer"
    size = layout.layer_bytes if per_layer else layout.block_bytes
    views, out_views = memoryview(data), memoryview(out)
    batches, sources, outs = [], [], []
    for first in range(0, n_blocks, BLOCKS_PER_BATCH):
        for layer in range(layout.layers if per_layer else 1):
            blocks = range(first, first + BLOCKS_PER_BATCH)
            offsets = [(b * (layout.layers if per_layer else 1) + layer) * size for b in blocks]
            batches.append([make_key(layout.name, b.to_bytes(8, "little"), layer) for b in blocks])
            sources.append([views[o : o + size] for o in offsets])
            outs.append([out_views[o : o + size] for o in offsets])
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


def measure(store: Phases, raw: Phases, repeat: int) -> tuple[float, float, float, float]:
    """Best (store put, store get, raw put, raw get) seconds over `repeat` rounds. Store and raw
    runs alternate inside each round so that both see the same background load."""
    best = [float("inf")] * 4
    for _ in range(repeat):
        for side, offset in ((raw, 2), (store, 0)):
            side.reset()
            best[offset] = min(best[offset], _timed(side.put))
        for side, offset in ((raw, 3), (store, 1)):
            best[offset] = min(best[offset], _timed(side.get))
    return best[0], best[1], best[2], best[3]


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


def raw_file_phases(root: Path, w: Workload) -> Phases:
    """Each entry to its own file (open/write/close), read back with readinto into its buffer."""
    paths = [[str(root / f"{i}-{j}") for j in range(len(b))] for i, b in enumerate(w.batches)]

    def reset() -> None:  # like the store's clear(): every put creates fresh files
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)

    def put() -> None:
        for batch_paths, src in zip(paths, w.sources):
            for path, payload in zip(batch_paths, src):
                with open(path, "wb") as f:
                    f.write(payload)

    def get() -> None:
        for batch_paths, out in zip(paths, w.outs):
            for path, buf in zip(batch_paths, out):
                with open(path, "rb", buffering=0) as f:
                    f.readinto(buf)

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
    with redis_server(args.redis_server) as url:
        for layout in LAYOUTS:
            for granularity in ("block", "layer"):
                w = make_workload(layout, granularity, total)
                for name in args.stores:
                    rows.append(_row(name, layout, granularity, w, url, args))
                    print(" | ".join(rows[-1]), file=sys.stderr)
    return rows


def _row(
    name: str, layout: Layout, granularity: str, w: Workload, url: str, args: argparse.Namespace
) -> tuple[str, ...]:
    if name == "file":
        root = Path(args.dir)
        store: KVStore = FileStore(root / "store", layout.name, capacity_bytes=4 * w.total_bytes)
        raw = raw_file_phases(root / "raw", w)
    else:
        store = RedisStore(url, layout.name)
        raw = raw_redis_phases(redis.Redis.from_url(url), w)
    with store:
        seconds = measure(store_phases(store, w), raw, args.repeat)
        store.clear()
        raw.reset()
    gbps = [w.total_bytes / s / 1e9 for s in seconds]
    cells = [f"{x:.2f}" for x in gbps] + [f"{gbps[0] / gbps[2]:.0%}", f"{gbps[1] / gbps[3]:.0%}"]
    return (name, layout.name, granularity, _kib(w.entry_bytes), *cells)


def _kib(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


HEADER = ("store", "layout", "granularity", "entry", "put GB/s", "get GB/s")
HEADER += ("raw put", "raw get", "put ratio", "get ratio")


def markdown_table(rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB per case, one repetition")
    parser.add_argument("--total-mib", type=int, default=256, help="data per case (MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per figure")
    parser.add_argument("--dir", default="/dev/shm/pdserve-bench", help="FileStore + raw dir")
    parser.add_argument("--stores", nargs="+", default=["file", "redis"])
    parser.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeat = 1
    try:
        print(markdown_table(run(args)))
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
