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

NOTE (why no reader ever sees a bad entry): a writer fills a private temp file — payload first
(one pwritev of its chunks at offset 64), then the header carrying the COMMITTED flag — and
renames it over the final name. rename(2) is atomic, so a name always points at a complete,
immutable inode; the header-last order also keeps a torn temp file (crash, ENOSPC) uncommitted.
Readers open the name, then read header and payload with one preadv (header, the caller's chunks,
one spare byte that must stay unread) and verify them: eviction unlinks the name and a re-put
renames a new inode over it, but an open fd keeps reading the old, complete inode (POSIX). A
missing name is a miss. A reader never blocks on a name: entries are opened with O_NONBLOCK and
anything but a regular file (a FIFO, a device: open() of a FIFO would wait for a writer forever,
wedging the engine that reads) is damage, missed and removed. What no flag bounds is a filesystem
that stalls inside a syscall (a hung NFS server): the node's engine then stops making progress,
and the router's progress timeout and `up`'s watchdog move its requests and replace it.

NOTE (parallel batches, and where the index is): a batch of large entries is split into contiguous
slices run by the store's worker threads (`workers`, default min(8, cpu count); the calling thread
runs one slice). os.preadv/pwritev release the GIL, so the slices' syscalls overlap; xxh3 holds it.
Small entries (below ~128 KiB) stay on the calling thread, where the GIL churn of a worker would
cost more than the overlap gains (`io_workers.py`). The LRU index (see `file_index.py`) is taken
once per put batch *before* the writes: one transaction evicts and records the whole batch; the
workers then write and rename with no lock held; one read of the batch's rows under the lock
afterwards ("settle") repairs the race this opens with evictions by other processes. Committed
bytes never exceed the capacity, the index and the directory agree between batches, and no block
write waits on SQLite or on another process. A get batch records its hits in one transaction after
its reads. Capacity counts file sizes (header + payload; tmpfs rounds each file up to a page) and
is enforced by writers: every process should be given the same one.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

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
from kv_store.file_index import FileIndex
from kv_store.io_workers import (
    BatchPool,
    as_payload,
    default_workers,
    preadv_all,
    pwritev_all,
)

logger = logging.getLogger(__name__)

DEFAULT_BASE = "/dev/shm/pdserve"
FINGERPRINT_FILE = "FINGERPRINT"  # the namespace's fingerprint in clear, for operators and the CLI
# a store given no capacity: a quarter of the free space of its filesystem, at most 4 GiB
DEFAULT_CAPACITY_FRACTION = 0.25
DEFAULT_CAPACITY_CAP = 4 * 2**30
_STALE_TEMP_S = 600.0  # a temp file this old belongs to a writer that died
_FANOUT = [f"{i:02x}" for i in range(256)]


def default_root(fingerprint: str, base: str | os.PathLike[str] = DEFAULT_BASE) -> Path:
    """The namespace directory of a fingerprint under `base`."""
    return Path(base) / entry.fingerprint_digest(fingerprint).hex()


def default_capacity(directory: Path) -> int:
    """The capacity of a store given none: DEFAULT_CAPACITY_FRACTION of the space free now on
    the filesystem that holds `directory` (not of its size: a quarter of a half-full disk, or
    of RAM-backed /dev/shm, is not there to take), capped at DEFAULT_CAPACITY_CAP. Said in one
    log line, with how to choose another."""
    st = os.statvfs(directory)
    free = st.f_frsize * st.f_bavail
    capacity = min(int(free * DEFAULT_CAPACITY_FRACTION), DEFAULT_CAPACITY_CAP)
    logger.info(
        "KV store in %s: no capacity given, using %.2f GiB (a quarter of the %.1f GiB free, at"
        " most %d GiB; set ?capacity=SIZE in the store URL)",
        directory,
        capacity / 2**30,
        free / 2**30,
        DEFAULT_CAPACITY_CAP // 2**30,
    )
    return capacity


def make_private_dir(path: Path) -> None:
    """mkdir -p with mode 0700 on the leaf, whatever the umask."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != 0o700:
        path.chmod(0o700)


class FileStore(KVStore):
    """KV entries as files under `root`, with a capacity and an LRU shared by all processes.

    Args:
        root: the namespace directory (see `default_root`); created 0700 if missing.
        fingerprint: layout fingerprint; stored in every header and checked on every read.
        capacity_bytes: bound on committed entry bytes; default `default_capacity`.
        fsync: fsync each entry before it is committed (pointless on tmpfs, so off by default).
        workers: threads that split each batch (default `default_workers()`; 1 = no threads).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        fingerprint: str,
        *,
        capacity_bytes: int | None = None,
        fsync: bool = False,
        workers: int | None = None,
    ) -> None:
        self.fingerprint = fingerprint
        self.root = Path(root)
        if not self.root.parent.exists():  # e.g. /dev/shm/pdserve on first use
            self.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        make_private_dir(self.root)
        for sub in _FANOUT:
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        self.capacity_bytes = (
            default_capacity(self.root) if capacity_bytes is None else capacity_bytes
        )
        self.fsync = fsync
        self._fp_digest = entry.fingerprint_digest(fingerprint)
        self._temp_ids = itertools.count()
        self._counters = Counters()
        self._warn = RateLimitedWarning(logger)
        self._pool = BatchPool(default_workers() if workers is None else workers)
        root = str(self.root)  # the index's callbacks see the directory only: it is shared
        self._index = FileIndex.shared(
            self.root,
            lambda name: _unlink_quietly(_entry_path(root, name)),
            lambda name: _size_of(_entry_path(root, name)),
        )
        marker = self.root / FINGERPRINT_FILE
        if not marker.exists():
            marker.touch(mode=0o600)
            marker.write_text(fingerprint)
        self._sweep_stale_temps()
        if self._index.created:
            self.reconcile()

    @property
    def workers(self) -> int:
        return self._pool.workers

    # -- names ----------------------------------------------------------------------------------

    @staticmethod
    def entry_name(key: str) -> str:
        """File name of a key: a hash of the key only, so any key is a safe, fixed-size name."""
        return hashlib.blake2b(key.encode(), digest_size=16).hexdigest()

    def _path(self, name: str) -> str:
        return _entry_path(self.root, name)

    def path_of(self, key: str) -> Path:
        """Where the entry of `key` lives (for tests and debugging)."""
        return Path(self._path(self.entry_name(key)))

    def _file_size(self, name: str) -> int | None:
        return _size_of(self._path(name))

    # -- writes ---------------------------------------------------------------------------------

    def put_many(
        self, keys: Sequence[str], payloads: Sequence[Payload], num_tokens: Sequence[int]
    ) -> list[bool]:
        check_lengths(keys, payloads, num_tokens)
        self._index.check_owner()
        chunks = [entry.chunk_views(p) for p in payloads]
        sizes = [entry.HEADER_SIZE + entry.payload_size(c) for c in chunks]
        names = [self.entry_name(key) for key in keys]
        last = {name: i for i, name in enumerate(names)}  # a repeated key: its last payload wins
        admitted: dict[str, int] = {}  # name → batch position, while the batch fits
        room = self.capacity_bytes
        for name, i in last.items():
            if sizes[i] <= room:
                admitted[name] = i
                room -= sizes[i]
        written = self._write_batch(admitted, sizes, chunks, num_tokens)
        ok = [written.get(name, False) for name in names]
        self._counters.add(puts=sum(ok))
        return ok

    def _write_batch(
        self,
        admitted: dict[str, int],
        sizes: list[int],
        chunks: list[list[memoryview]],
        num_tokens: Sequence[int],
    ) -> dict[str, bool]:
        """Reserve room for the admitted entries (name → batch position; `sizes`, `chunks` and
        `num_tokens` by position), write them in parallel, settle the index; returns name →
        published."""
        if not admitted:
            return {}
        reserved = {name: sizes[i] for name, i in admitted.items()}
        try:
            stamps = self._index.reserve(reserved, self.capacity_bytes)
        except sqlite3.Error as exc:
            self._write_error("the index", exc)
            return {}
        items = list(admitted.items())
        done = self._pool.map(
            lambda j: self._write_entry(items[j][0], chunks[items[j][1]], num_tokens[items[j][1]]),
            len(items),
            sum(reserved.values()),
        )
        written = {name: ok for (name, _), ok in zip(items, done)}
        try:
            self._index.settle(
                [n for n, ok in written.items() if ok],
                {n: stamps[n] for n, ok in written.items() if not ok},
            )
        except sqlite3.Error as exc:  # renamed files stay readable; reconcile() adopts them
            self._write_error("the index", exc)
        return written

    def _write_entry(self, name: str, chunks: list[memoryview], num_tokens: int) -> bool:
        """Write a complete entry to a fresh temp file and rename it into place (a worker's job:
        no lock held). False, with the temp file removed, on any failure."""
        header = entry.encode_header(self._fp_digest, num_tokens, as_payload(chunks))
        temp = f"{self.root}/{name[:2]}/.tmp-{name[2:]}-{os.getpid()}-{next(self._temp_ids)}"
        try:
            fd = self._create(temp, name[:2])
        except OSError as exc:
            self._write_error(temp, exc)
            return False
        try:
            try:
                # Payload first, header (with COMMITTED) last: a torn file is never committed.
                pwritev_all(fd, chunks, entry.HEADER_SIZE)
                if os.pwrite(fd, header, 0) != entry.HEADER_SIZE:
                    raise OSError("short write")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(temp, self._path(name))  # the atomic commit point
            return True
        except OSError as exc:  # typically ENOSPC
            self._write_error(temp, exc)
            _unlink_quietly(temp)
            return False

    def _create(self, temp: str, sub: str) -> int:
        """A new temp file in the fan-out directory ``sub``; the directories are made again
        when they were removed under a running store (an operator's ``rm -r``: every later
        write failed, until a restart)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            return os.open(temp, flags, 0o600)
        except FileNotFoundError:
            make_private_dir(self.root)
            make_private_dir(self.root / sub)
            return os.open(temp, flags, 0o600)

    def _write_error(self, what: str, exc: Exception) -> None:
        self._counters.add(errors=1)
        self._warn.warn("file store write of %s failed: %s", what, exc)

    # -- reads ----------------------------------------------------------------------------------

    def get_many_into(
        self, keys: Sequence[str], num_tokens: Sequence[int], out: Sequence[Destination]
    ) -> list[bool]:
        check_lengths(keys, num_tokens, out)
        self._index.check_owner()
        names = [self.entry_name(key) for key in keys]
        dsts = [entry.chunk_views(o) for o in out]
        nbytes = entry.payload_size(dsts[0]) * len(dsts) if dsts else 0  # a batch's are alike
        corrupt: list[str] = []
        found = self._pool.map(
            lambda i: self._read_into(names[i], num_tokens[i], dsts[i], corrupt), len(keys), nbytes
        )
        self._record_reads([name for name, hit in zip(names, found) if hit], len(keys))
        self._drop_corrupt(corrupt)
        return found

    def _read_into(
        self, name: str, num_tokens: int, dst: list[memoryview], corrupt: list[str]
    ) -> bool:
        """Read one entry straight into `dst` (one preadv: header, chunks, a spare byte that must
        stay unread, i.e. no trailing junk) and verify it; False on any mismatch, and a file
        that was read but does not verify, or is no regular file, is listed in `corrupt`
        (list.append: thread-safe)."""
        header = bytearray(entry.HEADER_SIZE)
        try:
            fd = _open_entry(self._path(name))
        except FileNotFoundError:
            return False
        except _NotAnEntry:
            corrupt.append(name)
            return False
        except OSError as exc:
            self._read_error(name, exc)
            return False
        try:
            got = preadv_all(fd, [header, *dst, bytearray(1)], 0)
        except OSError as exc:
            self._read_error(name, exc)
            return False
        finally:
            os.close(fd)
        if got != entry.HEADER_SIZE + entry.payload_size(dst):
            return False
        if entry.verify(header, as_payload(dst), self._fp_digest, num_tokens):
            return True
        if entry.damaged(header, as_payload(dst)):
            corrupt.append(name)
        return False

    def get_many(self, keys: Sequence[str], num_tokens: Sequence[int]) -> list[bytes | None]:
        check_lengths(keys, num_tokens)
        self._index.check_owner()
        names = [self.entry_name(key) for key in keys]
        corrupt: list[str] = []
        payloads = [self._read_whole(name, n, corrupt) for name, n in zip(names, num_tokens)]
        self._record_reads([nm for nm, p in zip(names, payloads) if p is not None], len(keys))
        self._drop_corrupt(corrupt)
        return payloads

    def _read_whole(self, name: str, num_tokens: int, corrupt: list[str]) -> bytes | None:
        try:
            with open(_open_entry(self._path(name)), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except _NotAnEntry:
            corrupt.append(name)
            return None
        except OSError as exc:
            self._read_error(name, exc)
            return None
        payload = entry.parse_and_verify(data, self._fp_digest, num_tokens)
        if payload is None:
            view = memoryview(data)
            if entry.damaged(view[: entry.HEADER_SIZE], view[entry.HEADER_SIZE :]):
                corrupt.append(name)
            return None
        return payload.tobytes()

    def _drop_corrupt(self, names: list[str]) -> None:
        """Entries that were read and did not verify are removed (file and row), so the next
        save writes them again: checked by name only, a damaged entry was missed on every
        request forever. Entries are renamed into place whole, so a failed check is damage,
        never a write in progress."""
        if not names:
            return
        self._counters.add(errors=len(names))
        self._warn.warn("file store: %d damaged entries removed (e.g. %s)", len(names), names[0])
        try:
            self._index.forget(names)
        except sqlite3.Error as exc:
            self._warn.warn("file store: removing damaged entries failed: %s", exc)

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
        if self._index.owned:
            self._pool.close()
        self._index.close()

    def __repr__(self) -> str:
        return (
            f"FileStore({str(self.root)!r}, capacity_bytes={self.capacity_bytes},"
            f" workers={self.workers})"
        )


def _entry_path(root: str | Path, name: str) -> str:
    return f"{root}/{name[:2]}/{name[2:]}"


class _NotAnEntry(OSError):
    """A name that is not a regular file: damage, never read (or waited on)."""


def _open_entry(path: str) -> int:
    """A read-only fd of the entry file at ``path``, opened without ever blocking: O_NONBLOCK
    makes open() of a FIFO return at once (it would wait for a writer), and anything but a
    regular file is refused (O_NONBLOCK changes nothing for a regular file's reads): a
    directory, which cannot be removed as an entry, with IsADirectoryError (a read error), any
    other kind (a FIFO, a socket, a device) with _NotAnEntry. Raises FileNotFoundError when the
    name is missing, OSError on other failures."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(f"{path} is a directory")
        raise _NotAnEntry(f"{path} is not a regular file")
    return fd


def _size_of(path: str) -> int | None:
    try:
        return os.stat(path).st_size
    except OSError:
        return None


def _unlink_quietly(path: str | Path) -> bool:
    """Unlink; True if something was removed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
