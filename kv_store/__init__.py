"""KV store backends: where prefill instances put KV blocks and decode instances get them.

`open_store(url, fingerprint)` picks a backend by URL scheme: `RedisStore` (`redis://`) or
`FileStore` (`file://`, a shared directory, default `/dev/shm/pdserve`). Every entry is framed by
`entry.py` (verified header + checksum), so a reader gets the exact payload or a miss.
"""

from kv_store.arena_store import ArenaStore
from kv_store.base import KVStore, StoreStats
from kv_store.entry import HEADER_SIZE, fingerprint_digest, make_key
from kv_store.file_store import FileStore
from kv_store.redis_store import RedisStore
from kv_store.url import open_store

__all__ = [
    "HEADER_SIZE",
    "ArenaStore",
    "FileStore",
    "KVStore",
    "RedisStore",
    "StoreStats",
    "fingerprint_digest",
    "make_key",
    "open_store",
]
