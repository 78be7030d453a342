"""KV store backends: where prefill instances put KV blocks and decode instances get them.

`open_store(url, fingerprint, payload_bytes=…)` picks a backend by URL scheme: `ArenaStore`
(`shm://`, one preallocated shared-memory arena per namespace, the `pdserve up` default),
`FileStore` (`file://`, a file per entry in a shared directory, default `/dev/shm/pdserve`) or
`RedisStore` (`redis://`, `rediss://`, and a Redis Cluster through `redis+cluster://` /
`rediss+cluster://`; `?connections=N` pipelines a large batch on N connections). Every entry is
framed by `entry.py` (verified header + checksum), so a reader gets the exact payload or a miss;
a payload may be given and read back as chunks (`base.Payload`, `base.Destination`).
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
