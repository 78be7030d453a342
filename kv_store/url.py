"""Open a KV store from a URL.

| URL | store |
| --- | --- |
| `redis://[user:password@]host:port/db[?ttl=SECONDS]`, `rediss://…`, `unix:///path.sock` | `RedisStore` |
| `file://` (base `/dev/shm/pdserve`) or `file:///base/dir[?capacity=8GiB&fsync=1]` | `FileStore` in `<base>/<fingerprint digest>` |

Keyword arguments override what the URL says (e.g. `ttl_s=`, `capacity_bytes=`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import redis

from kv_store import entry
from kv_store.base import KVStore
from kv_store.file_store import DEFAULT_BASE, FINGERPRINT_FILE, FileStore, default_root
from kv_store.redis_store import RedisStore, split_ttl

REDIS_SCHEMES = ("redis", "rediss", "unix")
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
    """The base directory of a `file://` URL (namespaces are its subdirectories)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ValueError(f"file store URL must be local (file:///path): {url!r}")
    return Path(parts.path or DEFAULT_BASE)


def open_store(url: str, fingerprint: str, **kw: Any) -> KVStore:
    """A store for `fingerprint` at `url`, selected by scheme. Raises ValueError on a bad URL."""
    scheme = urlsplit(url).scheme
    if scheme in REDIS_SCHEMES:
        return RedisStore(url, fingerprint, **kw)
    if scheme == "file":
        return _open_file_store(url, fingerprint, **kw)
    raise ValueError(f"unknown KV store URL scheme {scheme!r} in {url!r}")


def _open_file_store(url: str, fingerprint: str, **kw: Any) -> FileStore:
    query = dict(parse_qsl(urlsplit(url).query))
    unknown = query.keys() - {"capacity", "fsync"}
    if unknown:
        raise ValueError(f"unknown file store URL parameters {sorted(unknown)} in {url!r}")
    if "capacity" in query:
        kw.setdefault("capacity_bytes", parse_size(query["capacity"]))
    if "fsync" in query:
        kw.setdefault("fsync", query["fsync"].lower() in ("1", "true", "yes"))
    return FileStore(default_root(fingerprint, file_base(url)), fingerprint, **kw)


def list_fingerprints(url: str) -> list[str]:
    """Every fingerprint with entries (Redis) or a namespace directory (files) at `url`."""
    scheme = urlsplit(url).scheme
    if scheme == "file":
        base = file_base(url)
        markers = base.glob(f"*/{FINGERPRINT_FILE}") if base.is_dir() else []
        return sorted(m.read_text() for m in markers)
    if scheme in REDIS_SCHEMES:
        client = redis.Redis.from_url(split_ttl(url)[0])
        try:
            keys = [
                k.decode(errors="replace") for k in client.scan_iter(match="pdkv:*", count=1000)
            ]
        finally:
            client.close()
        return sorted({m[1] for k in keys if (m := _KEY_RE.match(k))})
    raise ValueError(f"unknown KV store URL scheme {scheme!r} in {url!r}")
