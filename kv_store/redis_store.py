"""`RedisStore`: KV entries as binary Redis strings, on one server or a Redis Cluster.

Atomicity: a Redis SET replaces the whole value in one step, so a reader sees the old entry, the
new one, or nothing; never half of one. That makes the write "two-phase" by construction: the
header (with its COMMITTED flag and both checksums) travels in the same SET as the payload, and
the checksums catch anything damaged after the fact (SETRANGE, a broken proxy).

Eviction is Redis's own (`maxmemory` + `allkeys-lru`, and an optional per-entry TTL): an evicted
entry is simply a miss; a write refused with OOM returns False for that entry.

NOTE: the hot path (SET / GET / EXISTS / UNLINK batches) does not go through redis-py's
`Pipeline`. redis-py owns the connection pools (connect, AUTH, SELECT, TLS, timeouts, cluster
topology) and the maintenance commands; the store writes its few commands on a pooled
connection's socket itself and reads the replies with a small RESP reader (`_Replies`), because
that is what removes the copies:

- put: a SET goes out as `*N $3 SET $k <key> $len <64-byte header>`, then every payload chunk as
  its own iovec (`sendmsg`, up to 1024 pieces per call; `sendall` per piece under TLS): the
  payload is never copied in user space, and 256 entries take ~13 syscalls instead of 513.
- get: a reply `$len` + header + payload is received with `recv_into` straight into the caller's
  destination chunks and verified there. Through redis-py, hiredis copied each value into its
  read buffer, then into a fresh `bytes` (page faults on every large value), and the store copied
  it once more: 0.6 → 1.2-1.3 GB/s on 512 KiB - 2 MiB entries (2-core box, local server).
- several connections: a batch is cut into up to `connections` contiguous slices of at least
  `MIN_SLICE_BYTES` (per node on a cluster), each pipelined on its own pooled connection: the
  first in the calling thread, the others on the store's thread pool (socket I/O releases the
  GIL). Replies are merged in key order.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import socket
import ssl
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

logger = logging.getLogger(__name__)

_SCAN_BATCH = 1000
_CONNECTION_ERRORS = (redis.RedisError, OSError)
_IOV_MAX = 1024  # Linux's limit on iovecs per sendmsg
_SCRATCH_BYTES = 1 << 16  # reply lines + the start of a payload land here; the rest goes direct
# A slice must carry at least this many bytes to be worth its own connection. Measured on the
# 2-core box (local server): splitting 0.5-2 MiB batches in 2-4 slices cost 20-40% of put and get
# throughput, 8-32 MiB batches gained or lost within noise; a 3-node cluster gained on gets.
MIN_SLICE_BYTES = 4 << 20
_KEY_COST = 64  # bytes-equivalent of a command without a payload (EXISTS, UNLINK)
# redis-py >= 5.3 deprecates get_connection's command-name argument that older versions require
_CHECKOUT_ARGS = (
    ()
    if inspect.signature(redis.ConnectionPool.get_connection).parameters["command_name"].default
    is None
    else ("GET",)
)


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


# -- wire: requests as socket pieces, replies read in place -------------------------------------


class Failure(NamedTuple):
    """A key that got no answer: an error reply (`OOM …`, `MOVED …`) or a lost connection."""

    message: str
    connection: bool

    @property
    def moved(self) -> bool:
        """The slot lives on another node now (cluster resharding or failover)."""
        return self.message.startswith(("MOVED ", "ASK "))


class _Replies:
    """RESP replies off a socket: lines through a scratch buffer, bulk payloads straight into
    caller buffers (`read_into`). Raises ConnectionError on EOF or a malformed reply."""

    def __init__(self, sock: socket.socket, scratch: bytearray) -> None:
        self._sock, self._buf, self._view = sock, scratch, memoryview(scratch)
        self._start = self._end = 0

    def head(self) -> tuple[bytes, bytes]:
        """The next reply's type byte (`+ - : $ _`) and the rest of its first line."""
        while (eol := self._buf.find(b"\r\n", self._start, self._end)) < 0:
            self._fill()
        line = bytes(self._view[self._start : eol])
        self._start = eol + 2
        if line[:1] not in (b"+", b"-", b":", b"$", b"_"):
            raise redis.ConnectionError(f"unexpected reply {line[:40]!r}")
        return line[:1], line[1:]

    def read_into(self, dst: memoryview) -> None:
        """Fill `dst` with the next bytes: what is buffered, then the rest from the socket."""
        have = min(len(dst), self._end - self._start)
        dst[:have] = self._view[self._start : self._start + have]
        self._start += have
        while have < len(dst):
            got = self._sock.recv_into(dst[have:])
            if not got:
                raise redis.ConnectionError("connection closed by the server")
            have += got

    def skip(self, n: int) -> None:
        while n:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start, n = self._start + take, n - take

    @property
    def drained(self) -> bool:
        return self._start == self._end

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):  # keep a partial line, make room after it
            if self._start == 0:
                raise redis.ConnectionError("reply line longer than the read buffer")
            n = self._end - self._start
            self._buf[:n] = self._view[self._start : self._end]
            self._start, self._end = 0, n
        got = self._sock.recv_into(self._view[self._end :])
        if not got:
            raise redis.ConnectionError("connection closed by the server")
        self._end += got


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _simple_reply(replies: _Replies) -> bytes | int | Failure | None:
    """A reply without a payload: status text, integer, nil, or the error as a Failure."""
    kind, rest = replies.head()
    if kind == b"-":
        return Failure(rest.decode(errors="replace"), connection=False)
    if kind == b":":
        return int(rest)
    if kind == b"$":
        if int(rest) < 0:
            return None
        value = bytearray(int(rest) + 2)
        replies.read_into(memoryview(value))
        return bytes(value[:-2])
    return rest if kind == b"+" else None


def _send(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    """Write every piece in order; large pieces are never joined (gather write)."""
    if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
        for piece in pieces:
            sock.sendall(piece)
        return
    i = 0
    while i < len(pieces):
        sent = sock.sendmsg(pieces[i : i + _IOV_MAX])
        while i < len(pieces) and len(pieces[i]) <= sent:
            sent -= len(pieces[i])
            i += 1
        if sent:
            pieces[i] = memoryview(pieces[i])[sent:]


def _coalesce(pieces: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """Join runs of `bytes` (command framing, headers); payload views stay separate."""
    out: list[bytes | memoryview] = []
    run: list[bytes] = []
    for piece in pieces:
        if isinstance(piece, bytes):
            run.append(piece)
            continue
        if run:
            out.append(b"".join(run))
            run = []
        out.append(piece)
    if run:
        out.append(b"".join(run))
    return out


# -- the batched commands ------------------------------------------------------------------------


class _Op(ABC):
    """One batched command: the request pieces of batch item i, and how to read its reply."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = keys

    def cost(self, i: int) -> int:
        """Bytes item i moves (slicing balances these)."""
        return _KEY_COST

    @abstractmethod
    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        """Append item i's command to `out`."""

    def reply(self, replies: _Replies, i: int) -> object:
        return _simple_reply(replies)


class _Set(_Op):
    """SET key <header + payload chunks> [EX ttl]; reply True, False or a Failure."""

    def __init__(self, keys, chunks, num_tokens, fp_digest: bytes, ttl_s: int | None) -> None:
        super().__init__(keys)
        self._chunks, self._num_tokens, self._fp = chunks, num_tokens, fp_digest
        self._sizes = [entry.payload_size(c) for c in chunks]
        self._ex = b"" if ttl_s is None else b"$2\r\nEX\r\n$%d\r\n%d\r\n" % (len(str(ttl_s)), ttl_s)

    def cost(self, i: int) -> int:
        return self._sizes[i]

    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        key, chunks = self.keys[i], self._chunks[i]
        header = entry.encode_header(self._fp, self._num_tokens[i], chunks)  # one xxh3 pass
        argc = 5 if self._ex else 3
        out.append(
            b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
            % (argc, len(key), key, entry.HEADER_SIZE + self._sizes[i], header)
        )
        out.extend(chunks)
        out.append(b"\r\n" + self._ex)

    def reply(self, replies: _Replies, i: int) -> object:
        value = _simple_reply(replies)
        return value if isinstance(value, Failure) else value == b"OK"


class _Get(_Op):
    """GET key, verified against the header. With destinations (`get_many_into`) the payload is
    received into them and the reply is True/False; without, it is the payload bytes or None."""

    def __init__(self, keys, num_tokens, fp_digest: bytes, dsts: list[list[memoryview]] | None):
        super().__init__(keys)
        self._num_tokens, self._fp, self._dsts = num_tokens, fp_digest, dsts
        self._sizes = None if dsts is None else [entry.payload_size(d) for d in dsts]

    def cost(self, i: int) -> int:
        return _KEY_COST if self._sizes is None else self._sizes[i]

    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        out.append(_command(b"GET", self.keys[i]))

    def reply(self, replies: _Replies, i: int) -> object:
        kind, rest = replies.head()
        if kind == b"-":
            return Failure(rest.decode(errors="replace"), connection=False)
        size = int(rest) if kind == b"$" else -1
        if size < 0:  # nil, or a reply no GET gives
            return None if self._dsts is None else False
        if self._dsts is None or self._sizes is None:
            value = bytearray(size + 2)
            replies.read_into(memoryview(value))
            view = entry.parse_and_verify(memoryview(value)[:size], self._fp, self._num_tokens[i])
            return None if view is None else view.tobytes()
        if size != entry.HEADER_SIZE + self._sizes[i]:
            replies.skip(size + 2)
            return False
        header = bytearray(entry.HEADER_SIZE)
        replies.read_into(memoryview(header))
        for chunk in self._dsts[i]:
            replies.read_into(chunk)
        replies.skip(2)
        return entry.verify(header, self._dsts[i], self._fp, self._num_tokens[i])


class _KeyCommand(_Op):
    """A one-key command with an integer reply (EXISTS, UNLINK)."""

    def __init__(self, name: bytes, keys: Sequence[bytes]) -> None:
        super().__init__(keys)
        self._name = name

    def request(self, i: int, out: list[bytes | memoryview]) -> None:
        out.append(_command(self._name, self.keys[i]))


def _split(indices: list[int], op: _Op, parts_max: int) -> list[list[int]]:
    """Cut `indices` into at most `parts_max` contiguous runs of about equal cost, none below
    `MIN_SLICE_BYTES`."""
    costs = [op.cost(i) for i in indices]
    total = sum(costs)
    parts = min(parts_max, len(indices), total // MIN_SLICE_BYTES)
    if parts <= 1:
        return [indices]
    runs: list[list[int]] = [[]]
    done = 0
    for i, cost in zip(indices, costs):
        if done >= total * len(runs) / parts and runs[-1]:
            runs.append([])
        runs[-1].append(i)
        done += cost
    return runs


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
        results = self._run(_Set(_encode(keys), chunks, num_tokens, self._fp_digest, self.ttl_s))
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
        results = self._run(_Get(_encode(keys), num_tokens, self._fp_digest, dsts))
        found = [r is True for r in results]
        self._counters.add(gets=len(keys), hits=sum(found))
        return found

    def get_many(self, keys: Sequence[str], num_tokens: Sequence[int]) -> list[bytes | None]:
        check_lengths(keys, num_tokens)
        results = self._run(_Get(_encode(keys), num_tokens, self._fp_digest, None))
        payloads = [r if isinstance(r, bytes) else None for r in results]
        self._counters.add(gets=len(keys), hits=sum(p is not None for p in payloads))
        return payloads

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        return [r == 1 for r in self._run(_KeyCommand(b"EXISTS", _encode(keys)))]

    def delete_many(self, keys: Sequence[str | bytes]) -> int:
        """Delete the keys; returns how many existed (0 for those on an unreachable node)."""
        results = self._run(_KeyCommand(b"UNLINK", _encode(keys)))
        return sum(r for r in results if isinstance(r, int) and not isinstance(r, bool))

    def _run(self, op: _Op) -> list[object]:
        """Every item's reply in key order; never raises for backend trouble (a `Failure`)."""
        results = self._run_items(op, list(range(len(op.keys))))
        failed = {i: r for i, r in enumerate(results) if isinstance(r, Failure)}
        if failed and self._topology.redirected(list(failed.values())):
            moved = [i for i, failure in failed.items() if failure.moved]
            for i, reply in zip(moved, self._run_items(op, moved)):
                results[i] = reply
            failed = {i: r for i, r in enumerate(results) if isinstance(r, Failure)}
        lost = [failure for failure in failed.values() if failure.connection]
        if lost:
            self._warn.warn("redis: %d of %d keys failed: %s", len(lost), len(results), lost[0])
        self._counters.add(errors=len(failed))
        return results

    def _run_items(self, op: _Op, indices: list[int]) -> list[object]:
        """Replies for `indices` (in that order): one slice per route and connection."""
        if not indices:
            return []
        slices = [
            Route(route.pool, part)
            for route in self._topology.routes(op.keys, indices)
            for part in _split(route.indices, op, self.connections)
        ]
        executor = self._pool() if len(slices) > 1 else None
        futures = [executor.submit(self._run_slice, op, s) for s in slices[1:]] if executor else []
        replies = dict(zip(slices[0].indices, self._run_slice(op, slices[0])))
        for s, future in zip(slices[1:], futures):
            replies.update(zip(s.indices, future.result()))
        for s in slices[1:] if executor is None else ():  # closed store: one after another
            replies.update(zip(s.indices, self._run_slice(op, s)))
        return [replies[i] for i in indices]

    def _run_slice(self, op: _Op, route: Route) -> list[object]:
        """One pipelined exchange on one pooled connection; a lost connection fails the rest."""
        n = len(route.indices)
        if route.pool is None:
            return [Failure("no reachable node serves this key", connection=True)] * n
        pieces: list[bytes | memoryview] = []
        for i in route.indices:
            op.request(i, pieces)
        try:
            conn = route.pool.get_connection(*_CHECKOUT_ARGS)
        except _CONNECTION_ERRORS as exc:
            return [Failure(str(exc) or type(exc).__name__, connection=True)] * n
        out: list[object] = []
        clean = False
        try:
            sock = _socket_of(conn)
            _send(sock, _coalesce(pieces))
            replies = _Replies(sock, self._scratch())
            out.extend(op.reply(replies, i) for i in route.indices)
            clean = replies.drained
        except _CONNECTION_ERRORS as exc:
            out += [Failure(str(exc) or type(exc).__name__, connection=True)] * (n - len(out))
        finally:
            if not clean:  # a half-read exchange leaves the socket out of step: drop it
                conn.disconnect()
            route.pool.release(conn)
        return out

    def _scratch(self) -> bytearray:
        scratch = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = self._local.scratch = bytearray(_SCRATCH_BYTES)
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


def _socket_of(conn: object) -> socket.socket:
    """The socket of a checked-out (hence connected) redis-py connection."""
    sock = getattr(conn, "_sock", None)
    if sock is None:
        raise redis.ConnectionError("pooled connection has no socket")
    return sock


def _encode(keys: Sequence[str | bytes]) -> list[bytes]:
    return [k if isinstance(k, bytes) else k.encode() for k in keys]
