"""`FileStore`: KV entries as files in a directory shared by every process of one machine.

```
<root>/                      0700   one namespace (fingerprint); default /dev/shm/pdserve/<digest>
  index.sqlite3 (+wal, shm)  0600   LRU index: name → size, last use; totals; shared counters
  index.lock                 0600   flock held around every index write transaction
  FINGERPRINT                0600   the fingerprint string, so a directory names its namespace
  00/ … ff/                  0700   fan-out on the first byte of the key hash
    <30 hex>                 0600   a committed entry: 64-byte header + payload
    .tmp-<30 hex>-<pid>-<n>  0600   a write in flight (never opened by readers)
```

NOTE (why no reader ever sees a bad entry): a writer fills a private temp file — payload first,
then the header carrying the COMMITTED flag — and renames it over the final name. rename(2) is
atomic, so a name always points at a complete, immutable inode; the header-last order also keeps
a torn temp file (crash, ENOSPC) uncommitted. Readers open the name, then read and verify header
and checksum from that fd: eviction unlinks the name and a re-put renames a new inode over it, but
an open fd keeps reading the old, complete inode (POSIX). A missing name is a miss.

NOTE (cross-process LRU): see `file_index.py`. A put evicts least-recently-used entries, renames
its temp files into place and records them in one index transaction, so the index and the
directory change together and committed bytes never exceed the capacity. A get records its hits
(one transaction per batch). Capacity counts file sizes (header + payload; tmpfs rounds each file
up to a page) and is enforced by writers: every process should be given the same one.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from kv_store import entry
from kv_store.base import Buffer, Counters, KVStore, RateLimitedWarning, StoreStats, check_lengths
from kv_store.file_index import FileIndex

logger = logging.getLogger(__name__)

DEFAULT_BASE = "/dev/shm/pdserve"
FINGERPRINT_FILE = "FINGERPRINT"  # the namespace's fingerprint in clear, for operators and the CLI
DEFAULT_CAPACITY_FRACTION = 0.25  # of the filesystem's size, when no capacity is given
_STALE_TEMP_S = 600.0  # a temp file this old belongs to a writer that died
_FANOUT = [f"{i:02x}" for i in range(256)]


def default_root(fingerprint: str, base: str | os.PathLike[str] = DEFAULT_BASE) -> Path:
    """The namespace directory of a fingerprint under `base`."""
    return Path(base) / entry.fingerprint_digest(fingerprint).hex()


def _make_private_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != 0o700:
        path.chmod(0o700)


class FileStore(KVStore):
    """KV entries as files under `root`, with a capacity and an LRU shared by all processes.

    Args:
        root: the namespace directory (see `default_root`); created 0700 if missing.
        fingerprint: layout fingerprint; stored in every header and checked on every read.
        capacity_bytes: bound on committed entry bytes; default a quarter of the filesystem.
        fsync: fsync each entry before it is committed (pointless on tmpfs, so off by default).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        *,
        capacity_bytes: int | None = None,
        fsync: bool = False,
    ) -> None:
        self.fingerprint = fingerprint
        self.root = Path(root)
        if not self.root.parent.exists():  # e.g. /dev/shm/pdserve on first use
            self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _make_private_dir(self.root)
        for sub in _FANOUT:
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        if capacity_bytes is None:
            st = os.statvfs(self.root)
            capacity_bytes = int(st.f_frsize * st.f_blocks * DEFAULT_CAPACITY_FRACTION)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._fp_digest = entry.fingerprint_digest(fingerprint)
        self._temp_ids = itertools.count()
        self._counters = Counters()
        self._warn = RateLimitedWarning(logger)
        self._index = FileIndex(self.root, lambda name: _unlink_quietly(self._path(name)))
        marker = self.root / FINGERPRINT_FILE
        if not marker.exists():
            marker.touch(mode=0o600)
            marker.write_text(fingerprint)
        self._sweep_stale_temps()
        if self._index.created:
            self.reconcile()

    # -- names ----------------------------------------------------------------------------------

    @staticmethod
    def entry_name(key: str) -> str:
        """File name of a key: a hash of the key only, so any key is a safe, fixed-size name."""
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def _path(self, name: str) -> str:
        return f"{self.root}/{name[:2]}/{name[2:]}"

    def path_of(self, key: str) -> Path:
        """Where the entry of `key` lives (for tests and debugging)."""
        return Path(self._path(self.entry_name(key)))

    # -- writes ---------------------------------------------------------------------------------

    def put_many(
        self, keys: Sequence[str], payloads: Sequence[Buffer], num_tokens: Sequence[int]
    ) -> list[bool]:
        check_lengths(keys, payloads, num_tokens)
        staged: list[tuple[int, str, str, int]] = []  # (batch position, name, temp path, size)
        for i, (key, payload, n) in enumerate(zip(keys, payloads, num_tokens)):
            name, view = self.entry_name(key), entry.byte_view(payload)
            temp = self._write_temp(name, entry.encode_header(self._fp_digest, n, view), view)
            if temp is not None:
                staged.append((i, name, temp, entry.HEADER_SIZE + len(view)))
        ok = [False] * len(keys)
        for i in self._commit(staged):
            ok[i] = True
        self._counters.add(puts=sum(ok))
        return ok

    def _write_temp(self, name: str, header: bytes, payload: memoryview) -> str | None:
        """Write a complete entry to a fresh temp file beside its final name; None on failure."""
        temp = f"{self.root}/{name[:2]}/.tmp-{name[2:]}-{os.getpid()}-{next(self._temp_ids)}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            self._write_error(temp, exc)
            return None
        try:
            # Payload first, header (with COMMITTED) last: a torn file is never committed.
            if os.pwrite(fd, payload, entry.HEADER_SIZE) != len(payload):
                raise OSError("short write")
            if os.pwrite(fd, header, 0) != entry.HEADER_SIZE:
                raise OSError("short write")
            if self.fsync:
                os.fsync(fd)
            return temp
        except OSError as exc:  # typically ENOSPC
            self._write_error(temp, exc)
            _unlink_quietly(temp)
            return None
        finally:
            os.close(fd)

    def _write_error(self, what: str, exc: Exception) -> None:
        self._counters.add(errors=1)
        self._warn.warn("file store write of %s failed: %s", what, exc)

    def _commit(self, staged: list[tuple[int, str, str, int]]) -> list[int]:
        """Admit staged temp files: evict LRU entries to make room, rename, record. Returns the
        batch positions committed; temp files not admitted (larger than capacity) are removed."""
        admitted, total = [], 0
        for item in staged:
            if total + item[3] <= self.capacity_bytes:
                admitted.append(item)
                total += item[3]
            else:
                _unlink_quietly(item[2])
        published: dict[str, int] = {}  # name → batch position

        def publish() -> dict[str, int]:
            for i, name, temp, _ in admitted:
                try:
                    os.rename(temp, self._path(name))  # the atomic commit point
                    published[name] = i
                except OSError as exc:
                    self._write_error(temp, exc)
                    _unlink_quietly(temp)
            return published

        try:
            if admitted:
                sizes = {name: size for _, name, _, size in admitted}
                self._index.admit(sizes, self.capacity_bytes, publish)
        except sqlite3.Error as exc:  # renamed files stay readable; reconcile() adopts them
            self._write_error("the index", exc)
        finally:  # never leave a temp file behind, whatever happened
            for item in admitted:
                _unlink_quietly(item[2])
        return list(published.values())

    # -- reads ----------------------------------------------------------------------------------

    def get_many_into(
        self, keys: Sequence[str], num_tokens: Sequence[int], out: Sequence[memoryview]
    ) -> list[bool]:
        check_lengths(keys, num_tokens, out)
        # Header and one spare byte (which must stay unread: no trailing junk), reused per key.
        frame = [bytearray(entry.HEADER_SIZE), bytearray(1)]
        names = [self.entry_name(key) for key in keys]
        found = [
            self._read_into(name, n, entry.byte_view(o), frame)
            for name, n, o in zip(names, num_tokens, out)
        ]
        self._record_reads([name for name, hit in zip(names, found) if hit], len(keys))
        return found

    def _read_into(
        self, name: str, num_tokens: int, dst: memoryview, frame: list[bytearray]
    ) -> bool:
        """Read one entry straight into `dst` (one readv) and verify it; False on any mismatch."""
        header, spare = frame
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError as exc:
            self._read_error(name, exc)
            return False
        try:
            got = os.readv(fd, [header, dst, spare])
        except OSError as exc:
            self._read_error(name, exc)
            return False
        finally:
            os.close(fd)
        return got == entry.HEADER_SIZE + len(dst) and entry.verify(
            header, dst, self._fp_digest, num_tokens
        )

    def get_many(self, keys: Sequence[str], num_tokens: Sequence[int]) -> list[bytes | None]:
        check_lengths(keys, num_tokens)
        names = [self.entry_name(key) for key in keys]
        payloads = [self._read_whole(name, n) for name, n in zip(names, num_tokens)]
        self._record_reads([nm for nm, p in zip(names, payloads) if p is not None], len(keys))
        return payloads

    def _read_whole(self, name: str, num_tokens: int) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._read_error(name, exc)
            return None
        payload = entry.parse_and_verify(data, self._fp_digest, num_tokens)
        return None if payload is None else payload.tobytes()

    def _read_error(self, name: str, exc: OSError) -> None:
        self._counters.add(errors=1)
        self._warn.warn("file store read of %s failed: %s", name, exc)

    def _record_reads(self, hit_names: list[str], num_keys: int) -> None:
        """Count the batch and move its hits to the most-recently-used end of the LRU."""
        self._counters.add(gets=num_keys, hits=len(hit_names))
        try:
            self._index.touch(hit_names, num_keys - len(hit_names))
        except sqlite3.Error as exc:  # LRU order is advisory; a failed touch loses no data
            self._warn.warn("file store LRU update failed: %s", exc)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """One stat() per key: there is no server to batch against, and a stat is ~1 µs."""
        return [os.path.exists(self._path(self.entry_name(key))) for key in keys]

    # -- maintenance ----------------------------------------------------------------------------

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._index.forget([self.entry_name(key) for key in keys])

    def clear(self) -> int:
        """Delete every entry (and every temp file) of this namespace."""
        return self._index.forget_all(self._remove_all_files)

    def _remove_all_files(self) -> int:
        return sum(_unlink_quietly(path) for path in self._entry_files(include_temps=True))

    def stats(self) -> StoreStats:
        t, c = self._index.totals(), self._counters
        return StoreStats(
            t.entries, t.bytes, c.puts, c.gets, c.hits, c.misses, c.errors,
            evictions=t.evictions, shared_hits=t.hits, shared_misses=t.misses,
        )  # fmt: skip

    def reconcile(self) -> tuple[int, int]:
        """Make the index match the directory (after a crash, or a lost index).

        Returns (files added to the index, index rows dropped for missing files); (0, 0) means the
        two already agreed. Adopted files count as least recently used, oldest mtime first.
        """
        return self._index.reconcile(self._scan)

    def _scan(self) -> dict[str, tuple[int, int]]:
        """name → (size, mtime_ns) of every committed entry file."""
        on_disk = {}
        for path in self._entry_files(include_temps=False):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                on_disk[path.parent.name + path.name] = (st.st_size, st.st_mtime_ns)
        return on_disk

    def _entry_files(self, *, include_temps: bool) -> Iterator[Path]:
        for sub in _FANOUT:
            with contextlib.suppress(FileNotFoundError):
                for path in (self.root / sub).iterdir():
                    if include_temps or not path.name.startswith(".tmp-"):
                        yield path

    def _sweep_stale_temps(self) -> None:
        """Remove temp files left by writers that died mid-put."""
        cutoff = time.time() - _STALE_TEMP_S
        for path in self._entry_files(include_temps=True):
            with contextlib.suppress(FileNotFoundError):
                if path.name.startswith(".tmp-") and path.stat().st_mtime < cutoff:
                    path.unlink()

    def close(self) -> None:
        self._index.close()

    def __repr__(self) -> str:
        return f"FileStore({str(self.root)!r}, capacity_bytes={self.capacity_bytes})"


def _unlink_quietly(path: str | Path) -> bool:
    """Unlink; True if something was removed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
