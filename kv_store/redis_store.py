"""`RedisStore`: KV entries as binary Redis strings, on one server or a Redis Cluster.

Atomicity: a Redis SET replaces the whole value in one step, so a reader sees the old entry, the
new one, or nothing; never half of one. That makes the write "two-phase" by construction: the
header (with its COMMITTED flag and both checksums) travels in the same SET as the payload, and
the checksums catch anything damaged after the fact (SETRANGE, a broken proxy).

Eviction is Redis's own (`maxmemory` + `allkeys-lru`, and an optional per-entry TTL): an evicted
entry is simply a miss; a write refused with OOM returns False for that entry.

NOTE: the hot path (SET / GET / EXISTS / UNLINK batches) does not go through redis-py's
`Pipeline`. redis-py owns the connection pools (connect, AUTH, SELECT, TLS, timeouts, cluster
topology) and the maintenance commands; the batches are written on a pooled connection's socket
and their replies read in place by `redis_wire.py`, because that is what removes the copies
(payload chunks go out as their own iovecs and come back straight into the caller's buffers).

The store decides where and how wide each batch goes: it is cut into up to `connections`
contiguous slices of at least `MIN_SLICE_BYTES` (per node on a cluster), each pipelined on its own
pooled connection: the first in the calling thread, the others on the store's thread pool (socket
I/O releases the GIL). Replies are merged in key order.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kv_store import entry
from kv_store.base import (
    Counters,
    Destination,
    KVStore,
    Payload,
    RateLimitedWarning,
    StoreStats,
    check_lengths,
)
from kv_store.redis_wire import (
    SCRATCH_BYTES,
    BatchCommand,
    Failure,
    GetCommand,
    KeyCommand,
    RawWireUnsupported,
    SetCommand,
    check_raw_wire,
    exchange,
    split_batch,
)

logger = logging.getLogger(__name__)

_SCAN_BATCH = 1000
# A slice must carry at least this many bytes to be worth its own connection. Measured on the
# 2-core box (local server): splitting 0.5-2 MiB batches in 2-4 slices cost 20-40% of put and get
# throughput, 8-32 MiB batches gained or lost within noise; a 3-node cluster gained on gets.
MIN_SLICE_BYTES = 4 << 20


def default_connections() -> int:
    """Pipelines in flight per node and call: one per core, at most 8."""
    return min(8, os.cpu_count() or 2)


class StoreOptions(NamedTuple):
    """Our query parameters of a Redis URL, and the URL left for redis-py."""

    url: str
    ttl_s: int | None
    connections: int | None


def split_options(url: str) -> StoreOptions:
    """Remove `ttl=SECONDS` and `connections=N` from a Redis URL (redis-py rejects them)."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in ("ttl", "connections")}
    if dict(query).get("protocol") not in (None, "2"):
        raise ValueError(f"RedisStore speaks RESP2; drop protocol= from {url!r}")
    rest = urlencode([(k, v) for k, v in query if k not in ours])
    ttl, conns = ours.get("ttl"), ours.get("connections")
    return StoreOptions(
        urlunsplit(parts._replace(query=rest)),
        int(ttl) if ttl else None,
        int(conns) if conns else None,
    )


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


# -- topology: where each key's commands go -----------------------------------------------------


class Route(NamedTuple):
    """Batch items (indices into the caller's keys) served by one node; `pool` None = no node."""

    pool: redis.ConnectionPool | None
    indices: list[int]


class Topology(ABC):
    """The nodes behind a store URL: one server (`SingleNode`) or a cluster (`redis_cluster`)."""

    @property
    @abstractmethod
    def width(self) -> int:
        """Nodes a batch may spread over (sizes the store's thread pool)."""

    @abstractmethod
    def routes(self, keys: Sequence[bytes], indices: list[int]) -> list[Route]:
        """Group `indices` by the node that owns `keys[i]`, keeping their order."""

    @abstractmethod
    def clients(self) -> list[redis.Redis]:
        """A client per primary, for the maintenance commands (SCAN, INFO)."""

    def redirected(self, failures: Sequence[Failure]) -> bool:
        """Learn from failed replies; True when the keys moved and are worth one retry."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Disconnect every pool."""


class SingleNode(Topology):
    """One server: every key goes to the same pool."""

    def __init__(self, url: str, socket_timeout_s: float, connect_timeout_s: float) -> None:
        # One retry without backoff reconnects a pooled socket left stale by a server restart
        # (maintenance commands; the hot path re-checks connections at checkout).
        pool = redis.ConnectionPool.from_url(
            url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
        )
        self._client = redis.Redis(connection_pool=pool)

    width = 1

    def routes(self, keys: Sequence[bytes], indices: list[int]) -> list[Route]:
        return [Route(self._client.connection_pool, indices)]

    def clients(self) -> list[redis.Redis]:
        return [self._client]

    def close(self) -> None:
        self._client.connection_pool.disconnect()

    def __repr__(self) -> str:
        return repr(self._client.connection_pool)


def open_topology(
    url: str, socket_timeout_s: float = 5.0, connect_timeout_s: float = 2.0
) -> Topology:
    """The topology of a URL without our query parameters (`redis+cluster://…` → a cluster)."""
    if urlsplit(url).scheme.endswith("+cluster"):
        from kv_store.redis_cluster import ClusterTopology

        return ClusterTopology(url, socket_timeout_s, connect_timeout_s)
    return SingleNode(url, socket_timeout_s, connect_timeout_s)


# -- the store -----------------------------------------------------------------------------------


class RedisStore(KVStore):
    """KV entries in Redis under `pdkv:{fingerprint}:*`.

    Args:
        url: `redis://[user:password@]host:port/db`, `rediss://…` (TLS), `unix:///path.sock`, or
            a cluster: `redis+cluster://host:port[,host:port…]`, `rediss+cluster://…`. Query
            parameters `ttl=SECONDS` and `connections=N` are ours; the others go to redis-py
            (e.g. `socket_timeout`, `ssl_ca_certs`).
        fingerprint: layout fingerprint; stored in every header and checked on every read.
        ttl_s: expiry of every entry written (overrides `?ttl=`); None = no expiry.
        connections: pipelines in flight per node for one large batch (overrides
            `?connections=`); default `default_connections()`.
        socket_timeout_s / connect_timeout_s: bound every call on a hung server or network.

    Thread-safe: any number of threads may call it at once (each slice checks out its own
    connection). `close()` stops the thread pool and drops the connections.
    """

    def __init__(
        self,
        url: str,
        fingerprint: str,
        *,
        ttl_s: int | None = None,
        connections: int | None = None,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        options = split_options(url)
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s if ttl_s is not None else options.ttl_s
        self.connections = connections or options.connections or default_connections()
        if self.connections < 1:
            raise ValueError(f"connections must be >= 1, got {self.connections}")
        self._fp_digest = entry.fingerprint_digest(fingerprint)
        self._prefix = f"{entry.KEY_PREFIX}:{fingerprint}:"
        self._topology = open_topology(options.url, socket_timeout_s, connect_timeout_s)
        try:
            check_raw_wire(self._topology.routes([b"pdkv:probe"], [0])[0].pool)
        except RawWireUnsupported:
            self._topology.close()
            raise
        self._counters = Counters()
        self._warn = RateLimitedWarning(logger)
        self._local = threading.local()  # per-thread reply scratch buffer
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._closed = False

    # -- hot path -------------------------------------------------------------------------------

    def put_many(
        self, keys: Sequence[str], payloads: Sequence[Payload], num_tokens: Sequence[int]
    ) -> list[bool]:
        check_lengths(keys, payloads, num_tokens)
        chunks = [entry.chunk_views(p) for p in payloads]
        results = self._run(
            SetCommand(_encode(keys), chunks, num_tokens, self._fp_digest, self.ttl_s)
        )
        refused = [r for r in results if isinstance(r, Failure) and not r.connection]
        if refused:  # OOM under maxmemory (noeviction, or nothing left to evict), huge value
            self._warn.warn("redis refused %d of %d puts: %s", len(refused), len(keys), refused[0])
        ok = [r is True for r in results]
        self._counters.add(puts=sum(ok))
        return ok

    def get_many_into(
        self, keys: Sequence[str], num_tokens: Sequence[int], out: Sequence[Destination]
    ) -> list[bool]:
        check_lengths(keys, num_tokens, out)
        dsts = [entry.chunk_views(o) for o in out]
        if any(c.readonly for d in dsts for c in d):
            raise ValueError("get_many_into needs writable destination buffers")
        results = self._run(GetCommand(_encode(keys), num_tokens, self._fp_digest, dsts))
        found = [r is True for r in results]
        self._counters.add(gets=len(keys), hits=sum(found))
        return found

    def get_many(self, keys: Sequence[str], num_tokens: Sequence[int]) -> list[bytes | None]:
        check_lengths(keys, num_tokens)
        results = self._run(GetCommand(_encode(keys), num_tokens, self._fp_digest, None))
        payloads = [r if isinstance(r, bytes) else None for r in results]
        self._counters.add(gets=len(keys), hits=sum(p is not None for p in payloads))
        return payloads

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [r == 1 for r in self._run(KeyCommand(b"EXISTS", _encode(keys)))]

    def delete_many(self, keys: Sequence[str | bytes]) -> int:
        """Delete the keys; returns how many existed (0 for those on an unreachable node)."""
        results = self._run(KeyCommand(b"UNLINK", _encode(keys)))
        return sum(r for r in results if isinstance(r, int) and not isinstance(r, bool))

    def _run(self, command: BatchCommand) -> list[object]:
        """Every item's reply in key order; never raises for backend trouble (a `Failure`)."""
        results = self._run_items(command, list(range(len(command.keys))))
        failed = {i: r for i, r in enumerate(results) if isinstance(r, Failure)}
        if failed and self._topology.redirected(list(failed.values())):
            moved = [i for i, failure in failed.items() if failure.moved]
            for i, reply in zip(moved, self._run_items(command, moved)):
                results[i] = reply
            failed = {i: r for i, r in enumerate(results) if isinstance(r, Failure)}
        lost = [failure for failure in failed.values() if failure.connection]
        if lost:
            self._warn.warn("redis: %d of %d keys failed: %s", len(lost), len(results), lost[0])
        self._counters.add(errors=len(failed))
        return results

    def _run_items(self, command: BatchCommand, indices: list[int]) -> list[object]:
        """Replies for `indices` (in that order): one slice per route and connection."""
        if not indices:
            return []
        slices = [
            Route(route.pool, part)
            for route in self._topology.routes(command.keys, indices)
            for part in split_batch(route.indices, command, self.connections, MIN_SLICE_BYTES)
        ]
        executor = self._pool() if len(slices) > 1 else None
        futures = (
            [executor.submit(self._run_slice, command, s) for s in slices[1:]] if executor else []
        )
        replies = dict(zip(slices[0].indices, self._run_slice(command, slices[0])))
        for s, future in zip(slices[1:], futures):
            replies.update(zip(s.indices, future.result()))
        for s in slices[1:] if executor is None else ():  # closed store: one after another
            replies.update(zip(s.indices, self._run_slice(command, s)))
        return [replies[i] for i in indices]

    def _run_slice(self, command: BatchCommand, route: Route) -> list[object]:
        """One slice's replies: `redis_wire.exchange` on its node's pool, with this thread's scratch."""
        if route.pool is None:
            n = len(route.indices)
            return [Failure("no reachable node serves this key", connection=True)] * n
        return exchange(route.pool, command, route.indices, self._scratch())

    def _scratch(self) -> bytearray:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = bytearray(SCRATCH_BYTES)
        return scratch

    def _pool(self) -> ThreadPoolExecutor | None:
        with self._executor_lock:
            if self._executor is None and not self._closed:
                workers = max(1, self.connections * self._topology.width - 1)
                self._executor = ThreadPoolExecutor(workers, thread_name_prefix="redis-store")
            return self._executor

    # -- maintenance (not hot; may raise redis errors) ------------------------------------------

    def _scan_batches(self, client: redis.Redis) -> Iterator[list[bytes]]:
        batch: list[bytes] = []
        pattern = _glob_escape(self._prefix) + "*"
        for key in client.scan_iter(match=pattern, count=_SCAN_BATCH):
            batch.append(key)
            if len(batch) == _SCAN_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def stats(self) -> StoreStats:
        """Exact entries/bytes by SCAN + pipelined STRLEN over the namespace on every primary:
        O(entries), meant for monitoring and the CLI, not the hot path. Evictions and shared
        hits/misses come from `INFO stats`, summed over the primaries, and are server-wide
        (every namespace and every non-pdserve key)."""
        entries = nbytes = evictions = hits = misses = 0
        for client in self._topology.clients():
            info = client.info("stats")  # before the STRLENs, which count as keyspace hits
            evictions += int(info.get("evicted_keys", 0))
            hits += int(info.get("keyspace_hits", 0))
            misses += int(info.get("keyspace_misses", 0))
            for batch in self._scan_batches(client):
                pipe = client.pipeline(transaction=False)
                for key in batch:
                    pipe.strlen(key)
                sizes = [s for s in pipe.execute() if s]  # 0: expired/evicted since the scan
                entries, nbytes = entries + len(sizes), nbytes + sum(sizes)
        c = self._counters
        return StoreStats(
            entries, nbytes, c.puts, c.gets, c.hits, c.misses, c.errors,
            evictions=evictions, shared_hits=hits, shared_misses=misses,
        )  # fmt: skip

    def clear(self) -> int:
        """UNLINK every key of this namespace on every primary (SCAN-based, so other namespaces
        are untouched)."""
        return sum(
            self.delete_many(batch)
            for client in self._topology.clients()
            for batch in self._scan_batches(client)
        )

    def close(self) -> None:
        with self._executor_lock:
            executor, self._executor, self._closed = self._executor, None, True
        if executor is not None:
            executor.shutdown(wait=True)
        self._topology.close()

    def __repr__(self) -> str:
        return f"RedisStore({self._topology!r}, fingerprint={self.fingerprint!r})"


def _encode(keys: Sequence[str | bytes]) -> list[bytes]:
    return [k if isinstance(k, bytes) else k.encode() for k in keys]
