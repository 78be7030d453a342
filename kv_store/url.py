"""Open a KV store from a URL.

| URL | store |
| --- | --- |
| `redis://[user:password@]host:port/db[?ttl=SECONDS&connections=N]`, `rediss://…`, `unix:///path.sock` | `RedisStore` |
| `redis+cluster://[user:password@]host:port[,host:port…][/?…]`, `rediss+cluster://…` (TLS) | `RedisStore` on a Redis Cluster |
| `file://` (base `/dev/shm/pdserve`) or `file:///base/dir[?capacity=8GiB&fsync=1&workers=N]` | `FileStore` in `<base>/<fingerprint digest>` |
| `shm://` (base `/dev/shm/pdserve`) or `shm:///base/dir[?capacity=8GiB&workers=N]` | `ArenaStore` in `<base>/<fingerprint digest>.arena` |

Keyword arguments override what the URL says (e.g. `ttl_s=`, `capacity_bytes=`, `workers=`).
`payload_bytes=` (the size of every entry's payload) is accepted for every scheme and used only by
`shm://`, whose arena needs it to be created (an existing arena has its own; a different one is
an error). File and arena stores default to min(8, cpu count) workers and a quarter of the
filesystem's size; an arena allocates all of it up front.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from kv_store import entry
from kv_store.arena_store import SUFFIX as ARENA_SUFFIX
from kv_store.arena_store import ArenaStore, arena_path, read_fingerprint
from kv_store.base import KVStore
from kv_store.file_store import DEFAULT_BASE, FINGERPRINT_FILE, FileStore, default_root
from kv_store.redis_store import RedisStore, open_topology, split_options

REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_UNITS |= {"ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
_KEY_RE = re.compile(rf"^{entry.KEY_PREFIX}:(.*):[0-9a-f]+(?::\d+)?$")


def parse_size(text: str) -> int:
    """`"8GiB"`, `"512M"`, `"1000000"` → bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if match is None:
        raise ValueError(f"not a size: {text!r}")
    return int(float(match[1]) * _UNITS[match[2] or ""])


def file_base(url: str) -> Path:
    """The base directory of a `file://` or `shm://` URL (namespaces are its subdirectories,
    or its `.arena` files)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{parts.scheme} store URL must be local ({parts.scheme}:///path): {url!r}"
        )
    return Path(parts.path or DEFAULT_BASE)


def open_store(
    url: str, fingerprint: str, *, payload_bytes: int | None = None, **kw: Any
) -> KVStore:
    """A store for `fingerprint` at `url`, selected by scheme. Raises ValueError on a bad URL.

    `payload_bytes` goes to the arena (`shm://`) only; other stores take any payload size."""
    scheme = urlsplit(url).scheme
    if scheme in REDIS_SCHEMES:
        return RedisStore(url, fingerprint, **kw)
    if scheme == "file":
        root = default_root(fingerprint, file_base(url))
        return FileStore(root, fingerprint, **_local_options(url, kw, "fsync"))
    if scheme == "shm":
        path = arena_path(fingerprint, file_base(url))
        return ArenaStore(path, fingerprint, payload_bytes=payload_bytes, **_local_options(url, kw))
    raise ValueError(f"unknown KV store URL scheme {scheme!r} in {url!r}")


def _local_options(url: str, kw: dict[str, Any], *extra: str) -> dict[str, Any]:
    """Keyword arguments of a file or arena store: `kw`, then the URL's query for the rest."""
    query = dict(parse_qsl(urlsplit(url).query))
    unknown = query.keys() - {"capacity", "workers", *extra}
    if unknown:
        raise ValueError(f"unknown URL parameters {sorted(unknown)} in {url!r}")
    if "capacity" in query:
        kw.setdefault("capacity_bytes", parse_size(query["capacity"]))
    if "workers" in query:
        kw.setdefault("workers", int(query["workers"]))
    if "fsync" in query:
        kw.setdefault("fsync", query["fsync"].lower() in ("1", "true", "yes"))
    return kw


def list_fingerprints(url: str) -> list[str]:
    """Every fingerprint with entries (Redis), a namespace directory (files) or an arena (shm)
    at `url`."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        base = file_base(url)
        markers = base.glob(f"*/{FINGERPRINT_FILE}") if base.is_dir() else []
        return sorted(m.read_text() for m in markers)
    if scheme == "shm":
        base = file_base(url)
        arenas = base.glob(f"*{ARENA_SUFFIX}") if base.is_dir() else []
        return sorted(read_fingerprint(path) for path in arenas)
    if scheme in REDIS_SCHEMES:
        topology = open_topology(split_options(url).url)  # every primary of a cluster
        try:
            keys = [
                k.decode(errors="replace")
                for client in topology.clients()
                for k in client.scan_iter(match="pdkv:*", count=1000)
            ]
        finally:
            topology.close()
        return sorted({m[1] for k in keys if (m := _KEY_RE.match(k))})
    raise ValueError(f"unknown KV store URL scheme {scheme!r} in {url!r}")
