"""The `KVStore` contract shared by every backend, its statistics, and small shared helpers.

A store maps str keys (see `entry.make_key`) to binary entries framed by `entry.py`. Callers pass
payloads in and read payloads out; framing and verification stay inside the store, so a caller
sees either the exact bytes that were put for that key or a miss.

Failure contract: a store is a cache, never the only copy. Reads and membership tests never raise
for backend trouble (unreachable server, missing/corrupt/foreign entry): they report a miss and
count an error where the backend failed. Writes report `False` per entry that is not durable.
Programming errors (mismatched batch lengths, wrong buffer sizes) still raise `ValueError`.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

Buffer = memoryview | bytes | bytearray
# One entry's payload: a single buffer, or its consecutive pieces ("chunks": e.g. the per-layer
# slices of a layer-major staging buffer). A store treats the chunks as one payload, in order.
Payload = Buffer | Sequence[Buffer]
# Where a read lands: one writable buffer of the payload's size, or writable chunks whose sizes
# add up to it (filled in order: a scatter read).
Destination = memoryview | Sequence[memoryview]


@dataclass(frozen=True)
class StoreStats:
    """A snapshot of a store.

    `entries`, `bytes` and `evictions` describe the whole namespace (every process using it);
    `bytes` counts header + payload. `puts`, `gets`, `hits`, `misses`, `errors` count keys seen
    by this handle only. `shared_hits`/`shared_misses` are lifetime counts over every client of
    the backend where it keeps them (None otherwise; for Redis they are server-wide).
    """

    entries: int
    bytes: int
    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    errors: int = 0
    evictions: int | None = None
    shared_hits: int | None = None
    shared_misses: int | None = None

    @property
    def hit_rate(self) -> float | None:
        """Hits / gets of this handle; None before the first get."""
        return self.hits / self.gets if self.gets else None

    @property
    def shared_hit_rate(self) -> float | None:
        """Hit rate over every client of the backend, where known."""
        if self.shared_hits is None or self.shared_misses is None:
            return None
        total = self.shared_hits + self.shared_misses
        return self.shared_hits / total if total else None


class KVStore(ABC):
    """Binary entries keyed by str.

    Thread-safe for concurrent calls from one writer thread and one reader thread (the connector's
    save and load paths). Every batched call is one round trip to the backend where it has them.
    A store never unpickles anything: entries are raw bytes behind a verified header.
    """

    fingerprint: str

    @abstractmethod
    def put_many(
        self, keys: Sequence[str], payloads: Sequence[Payload], num_tokens: Sequence[int]
    ) -> list[bool]:
        """Frame each payload with an entry header and store it under its key.

        Payloads are only read (C-contiguous buffers, or sequences of them taken as one payload
        in order). Returns, per key, True when the entry is durable in the store now (a later
        reader will find it unless it is evicted).
        """

    @abstractmethod
    def get_many_into(
        self, keys: Sequence[str], num_tokens: Sequence[int], out: Sequence[Destination]
    ) -> list[bool]:
        """Read payloads into caller-owned writable buffers of exactly the payload size (or
        sequences of writable chunks whose sizes add up to it, filled in order).

        Returns, per key, True when `out[i]` now holds the verified payload. False (a miss) when
        the entry is absent, evicted, corrupt, for another fingerprint / token count / size, or
        the backend is unreachable; the content of `out[i]` is then unspecified.
        """

    @abstractmethod
    def get_many(self, keys: Sequence[str], num_tokens: Sequence[int]) -> list[bytes | None]:
        """Convenience read: the verified payload per key, or None for a miss."""

    @abstractmethod
    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present, in one batched round trip. Does not verify content."""

    @abstractmethod
    def delete_many(self, keys: Sequence[str]) -> int:
        """Delete the keys; returns how many existed."""

    @abstractmethod
    def stats(self) -> StoreStats:
        """A snapshot of the store (see `StoreStats`)."""

    @abstractmethod
    def clear(self) -> int:
        """Delete every entry of this store's namespace; returns how many were deleted."""

    @abstractmethod
    def close(self) -> None:
        """Release connections and file handles. Idempotent."""

    def __enter__(self) -> KVStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Counters:
    """Per-handle operation counters, safe to bump from the writer and the reader thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.puts = self.gets = self.hits = self.misses = self.errors = 0

    def add(self, *, puts: int = 0, gets: int = 0, hits: int = 0, errors: int = 0) -> None:
        with self._lock:
            self.puts += puts
            self.gets += gets
            self.hits += hits
            self.misses += gets - hits
            self.errors += errors


class RateLimitedWarning:
    """Logs a warning at most once per `interval_s`, counting what it suppressed in between.

    A dead backend fails every call of a busy engine; one line per interval is enough.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._last = float("-inf")
        self._suppressed = 0
        self._lock = threading.Lock()

    def warn(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._interval_s:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            msg += " (%d similar warnings suppressed)"
            args = (*args, suppressed)
        self._logger.warning(msg, *args)


def check_lengths(keys: Sequence[str], *others: Sequence[object]) -> None:
    """Raise ValueError unless every batch argument has one element per key."""
    for other in others:
        if len(other) != len(keys):
            raise ValueError(f"batch length mismatch: {len(keys)} keys vs {len(other)} items")
