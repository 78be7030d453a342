"""`RedisStore`: KV entries as binary Redis strings, one pipeline per batched call.

Atomicity: a Redis SET replaces the whole value in one step, so a reader sees the old entry, the
new one, or nothing; never half of one. That makes the write "two-phase" by construction: the
header (with its COMMITTED flag and both checksums) travels in the same SET as the payload, and
the checksums catch anything damaged after the fact (SETRANGE, a broken proxy).

Eviction is Redis's own (`maxmemory` + `allkeys-lru`, and an optional per-entry TTL): an evicted
entry is simply a miss; a write refused with OOM returns False for that entry.

Hot path, put: a SET needs one bulk string, but RESP only needs the bytes in order on the socket.
`_FramedPacker` writes `$<len>\\r\\n`, the 64-byte header and then the caller's payload buffer as
separate chunks for `sendall`, so the payload is never copied in user space (redis-py's hiredis
packer would copy it twice: `bytes(memoryview)` and `pack_command`). Hot path, get: hiredis
returns each value as one `bytes` (one copy, unavoidable with redis-py); we verify it and copy the
payload into the caller's buffer. benchmarks/kv_transfer.py measures both against plain redis-py.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from typing import NamedTuple
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kv_store import entry
from kv_store.base import Buffer, Counters, KVStore, RateLimitedWarning, StoreStats, check_lengths

logger = logging.getLogger(__name__)

_SCAN_BATCH = 1000
_CONNECTION_ERRORS = (redis.RedisError, OSError)


class _FramedValue(NamedTuple):
    """A SET value sent as header + payload without joining them (see `_FramedPacker`)."""

    header: bytes
    payload: memoryview


class _FramedPacker:
    """RESP command packer that accepts `_FramedValue` args and never copies large buffers.

    Returns a list of chunks; redis-py's `pack_commands` coalesces the small ones and passes
    memoryviews through untouched to `sock.sendall`.
    """

    def pack(self, *args: object) -> list[bytes | memoryview]:
        if isinstance(args[0], str) and " " in args[0]:  # e.g. "CLIENT SETINFO" → two args
            args = (*args[0].split(), *args[1:])
        chunks: list[bytes | memoryview] = []
        parts: list[bytes | memoryview] = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, _FramedValue):
                size = len(arg.header) + len(arg.payload)
                parts += [b"$%d\r\n" % size, arg.header]
                chunks += [b"".join(parts), arg.payload]
                parts = [b"\r\n"]
            else:
                data = _encode(arg)
                parts += [b"$%d\r\n" % len(data), data, b"\r\n"]
        chunks.append(b"".join(parts))
        return chunks


def _encode(arg: object) -> bytes | memoryview:
    """A command argument as bytes, the way redis-py's encoder does it (no decoding options)."""
    if isinstance(arg, bytes | bytearray):
        return bytes(arg)
    if isinstance(arg, memoryview):
        return arg.cast("B") if arg.format != "B" else arg
    if isinstance(arg, str):
        return arg.encode()
    if isinstance(arg, int | float) and not isinstance(arg, bool):
        return repr(arg).encode()
    raise redis.DataError(f"cannot send a {type(arg).__name__} to redis")


def split_ttl(url: str) -> tuple[str, int | None]:
    """Remove our `ttl=SECONDS` query parameter from a Redis URL; redis-py rejects unknown ones."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ttl = [v for k, v in query if k == "ttl"]
    rest = urlencode([(k, v) for k, v in query if k != "ttl"])
    return urlunsplit(parts._replace(query=rest)), (int(ttl[-1]) if ttl else None)


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisStore(KVStore):
    """KV entries in Redis under `pdkv:{fingerprint}:*`.

    Args:
        url: `redis://[user:password@]host:port/db[?ttl=SECONDS]`, `rediss://...` or
            `unix:///path.sock`; other query parameters go to redis-py (e.g. `socket_timeout`).
        fingerprint: layout fingerprint; stored in every header and checked on every read.
        ttl_s: expiry of every entry written (overrides `?ttl=`); None = no expiry.
        socket_timeout_s / connect_timeout_s: bound every call on a hung server or network.
    """

    def __init__(
        self,
        url: str,
        fingerprint: str,
        *,
        ttl_s: int | None = None,
        socket_timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
    ) -> None:
        clean_url, url_ttl = split_ttl(url)
        self.fingerprint = fingerprint
        self.ttl_s = ttl_s if ttl_s is not None else url_ttl
        self._fp_digest = entry.fingerprint_digest(fingerprint)
        self._prefix = f"{entry.KEY_PREFIX}:{fingerprint}:"
        # One retry without backoff reconnects a pooled socket left stale by a server restart;
        # a server that is really down then fails fast instead of stalling the engine.
        pool = redis.ConnectionPool.from_url(
            clean_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
            command_packer=_FramedPacker(),
        )
        self._client = redis.Redis(connection_pool=pool)
        self._counters = Counters()
        self._warn = RateLimitedWarning(logger)

    # -- hot path -------------------------------------------------------------------------------

    def put_many(
        self, keys: Sequence[str], payloads: Sequence[Buffer], num_tokens: Sequence[int]
    ) -> list[bool]:
        check_lengths(keys, payloads, num_tokens)
        pipe = self._client.pipeline(transaction=False)
        for key, payload, n in zip(keys, payloads, num_tokens):
            view = entry.byte_view(payload)
            value = _FramedValue(entry.encode_header(self._fp_digest, n, view), view)
            pipe.set(key, value, ex=self.ttl_s)  # type: ignore[arg-type]
        replies = self._execute(pipe, len(keys), "put")
        ok = [reply is True for reply in replies]
        refused = [r for r in replies if isinstance(r, redis.ResponseError)]
        if refused:  # OOM under maxmemory (noeviction, or nothing left to evict), huge value
            self._warn.warn("redis refused %d of %d puts: %s", len(refused), len(keys), refused[0])
        self._counters.add(puts=sum(ok), errors=len(refused))
        return ok

    def get_many_into(
        self, keys: Sequence[str], num_tokens: Sequence[int], out: Sequence[memoryview]
    ) -> list[bool]:
        check_lengths(keys, num_tokens, out)
        values = self._fetch(keys)
        found = [self._copy_verified(v, n, o) for v, n, o in zip(values, num_tokens, out)]
        self._counters.add(gets=len(keys), hits=sum(found))
        return found

    def get_many(self, keys: Sequence[str], num_tokens: Sequence[int]) -> list[bytes | None]:
        check_lengths(keys, num_tokens)
        payloads = []
        for value, n in zip(self._fetch(keys), num_tokens):
            view = entry.parse_and_verify(value, self._fp_digest, n) if value else None
            payloads.append(None if view is None else view.tobytes())
        self._counters.add(gets=len(keys), hits=sum(p is not None for p in payloads))
        return payloads

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return [reply == 1 for reply in self._execute(pipe, len(keys), "contains")]

    def _fetch(self, keys: Sequence[str]) -> list[bytes | None]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        return [v if isinstance(v, bytes) else None for v in self._execute(pipe, len(keys), "get")]

    def _copy_verified(self, value: bytes | None, num_tokens: int, out: memoryview) -> bool:
        if value is None:
            return False
        dst = entry.byte_view(out)
        payload = entry.parse_and_verify(value, self._fp_digest, num_tokens, len(dst))
        if payload is None:
            return False
        dst[:] = payload
        return True

    def _execute(self, pipe: redis.client.Pipeline, n: int, what: str) -> list[object]:
        """Run a pipeline; on a connection failure log (rate-limited) and return n errors."""
        if n == 0:
            return []
        try:
            return pipe.execute(raise_on_error=False)
        except _CONNECTION_ERRORS as exc:
            self._warn.warn("redis %s of %d keys failed: %s", what, n, exc)
            self._counters.add(errors=n)
            return [exc] * n

    # -- maintenance (not hot; may raise redis errors) ------------------------------------------

    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete the keys; returns how many existed (0 if Redis is unreachable)."""
        if not keys:
            return 0
        try:
            return int(self._client.unlink(*keys))
        except _CONNECTION_ERRORS as exc:
            self._warn.warn("redis delete of %d keys failed: %s", len(keys), exc)
            self._counters.add(errors=len(keys))
            return 0

    def _scan_batches(self) -> Iterator[list[bytes]]:
        batch: list[bytes] = []
        pattern = _glob_escape(self._prefix) + "*"
        for key in self._client.scan_iter(match=pattern, count=_SCAN_BATCH):
            batch.append(key)
            if len(batch) == _SCAN_BATCH:
                yield batch
                batch = []
        if batch:
            yield batch

    def stats(self) -> StoreStats:
        """Exact entries/bytes by SCAN + pipelined STRLEN over the namespace: O(entries), meant for
        monitoring and the CLI, not the hot path. Evictions and shared hits/misses come from
        `INFO stats` and are server-wide (every namespace and every non-pdserve key)."""
        entries = nbytes = 0
        for batch in self._scan_batches():
            pipe = self._client.pipeline(transaction=False)
            for key in batch:
                pipe.strlen(key)
            sizes = [s for s in pipe.execute() if s]  # 0: expired/evicted since the scan
            entries, nbytes = entries + len(sizes), nbytes + sum(sizes)
        info = self._client.info("stats")
        c = self._counters
        return StoreStats(
            entries, nbytes, c.puts, c.gets, c.hits, c.misses, c.errors,
            evictions=int(info.get("evicted_keys", 0)),
            shared_hits=int(info.get("keyspace_hits", 0)),
            shared_misses=int(info.get("keyspace_misses", 0)),
        )  # fmt: skip

    def clear(self) -> int:
        """UNLINK every key of this namespace (SCAN-based, so other namespaces are untouched)."""
        return sum(int(self._client.unlink(*batch)) for batch in self._scan_batches())

    def close(self) -> None:
        self._client.connection_pool.disconnect()

    def __repr__(self) -> str:
        return f"RedisStore({self._client.connection_pool!r}, fingerprint={self.fingerprint!r})"
