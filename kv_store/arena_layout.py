"""The on-file layout of an `ArenaStore` arena: header, geometry, index table, slot metadata, and
the creation, opening, checking and mapping of the file.

```
<base>/<fingerprint digest>.arena          0600; default base /dev/shm/pdserve (0700)
  [0, 4096)   header    magic, version, slot protocol, fingerprint digest, payload bytes, slot
                        size and count, table size (checksummed, immutable); counters (CLOCK hand,
                        evictions, hits, misses); the fingerprint string, for the CLI
  table       open addressing, a power of two ≥ 2 × slots:  key0 u64 | key1 u64 | slot + 1 u32
              (0 = empty, 0xffffffff = tombstone), key = blake2b-128 of the store key
  slot meta   one column per field: gen u64 | key0 u64 | key1 u64 | xxh u64 | stamp u64 |
              owner u64 (pid namespace << 32 | pid) | state u8 (FREE, WRITING, COMMITTED) | ref u8
  slots       slot_count × slot_size: 64-byte entry header + payload (`payload_bytes`, fixed
              per namespace), each slot 64-byte aligned
```

The file is sized and allocated when it is created (posix_fallocate: ENOSPC then, not SIGBUS
on a full tmpfs later), linked into place only once complete, and mapped MAP_SHARED |
MAP_POPULATE by every process, so no copy pays a page fault or a page allocation: that is what
makes a put 3-4x faster than writing a file on tmpfs (docs/BENCHMARKS.md, "KV transfer"). Never
truncate an arena in use (a process touching a page past the end gets SIGBUS); removing or
replacing the file is safe: its handles move to the arena at its path (`ArenaStore`).

NOTE (who orders what): the slot state words (generation, state, key, checksum, reference bit)
change only through the arena's slot protocol (`arena_slots.py`), chosen when the file is
created and recorded in its header: C11 atomics with acquire/release orderings and lock-free
reads (`AtomicSlots`, ``csrc/arena_slots.c`` states the argument), or every read under the arena
lock (`LockedSlots`, where no C compiler exists). Everything else here (the table, the counters,
the CLOCK hand) is written under the arena lock only, and the lock (an flock: mutual exclusion,
ordered by the kernel as a mutex is) orders it for the next holder. Lock-free table probes read
cells that a writer may be changing: any value they read is at worst a miss, because a probe's
answer is only a slot to try, and the slot's own key, read through the protocol, decides.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash

from kv_store import entry
from kv_store.arena_slots import (
    COMMITTED,
    SLOT_COLUMNS,
    AtomicSlots,
    LockedSlots,
    load_error,
    load_library,
)
from kv_store.file_store import DEFAULT_BASE, default_capacity, make_private_dir

logger = logging.getLogger(__name__)

SUFFIX = ".arena"
MAGIC, VERSION = b"PDKVAREN", 2
LOCKED_READS = 1  # header flag: the arena's reads take the lock (`LockedSlots`)
_PAGE = 4096
_EMPTY, _TOMB = 0, 0xFFFFFFFF
_U64 = (1 << 64) - 1
_GEN_LIMIT = 1 << 63  # a reader gets a generation as an int64 (negative: a miss); never counted to
_PID_MAX = 1 << 22  # the kernel's PID_MAX_LIMIT: a larger owner pid is damage, not a process
_HEADER = struct.Struct("<8sII16sQQII")  # magic, version, flags, fp digest, payload, slot, n, table
_HEADER_XXH = struct.Struct("<Q")  # xxh3 of _HEADER, right after it: 64 immutable bytes
_HAND, _TABLE_USED, _EVICTIONS, _HITS, _MISSES = range(5)  # u64 counters at byte 64
_FP_OFFSET = 256  # u16 length + UTF-8 fingerprint
_TABLE_COLUMNS = (("tkey0", "Q"), ("tkey1", "Q"), ("tslot", "I"))


class ArenaGeometryError(ValueError):
    """The arena file does not match what the caller asked for, or is not an arena."""


class ArenaDamagedError(ArenaGeometryError):
    """The file at an arena's path is not a whole arena (a bad or inconsistent header, a size
    that is not its header's): `open_arena` replaces it when it may create one."""


class ArenaProtocolError(ArenaGeometryError):
    """The arena's slot protocol (recorded in its header) is one this process cannot run."""


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Geometry:
    """Shape of an arena file; every offset is derived from these two numbers."""

    payload_bytes: int
    slot_count: int

    @classmethod
    def for_capacity(cls, payload_bytes: int, capacity_bytes: int) -> Geometry:
        """As many slots as fit in `capacity_bytes` (slot bytes only; metadata is ~0.1 KiB per
        slot on top)."""
        if payload_bytes < 1:
            raise ValueError(f"payload_bytes must be >= 1, got {payload_bytes}")
        slots = capacity_bytes // _round_up(entry.HEADER_SIZE + payload_bytes, 64)
        if slots < 1 or slots >= _TOMB:
            raise ValueError(f"capacity {capacity_bytes} B holds {slots} slots of this size")
        return cls(payload_bytes, slots)

    @property
    def slot_size(self) -> int:
        return _round_up(entry.HEADER_SIZE + self.payload_bytes, 64)

    @property
    def table_size(self) -> int:
        return max(8, 1 << (2 * self.slot_count - 1).bit_length())

    def columns(self) -> list[tuple[str, str, int, int]]:
        """(name, struct format, length, byte offset) of each table and slot column, each
        64-byte aligned, after the header page."""
        out, at = [], _PAGE
        for columns, count in ((_TABLE_COLUMNS, self.table_size), (SLOT_COLUMNS, self.slot_count)):
            for name, fmt in columns:
                out.append((name, fmt, count, at))
                at = _round_up(at + struct.calcsize(fmt) * count, 64)
        return out

    @property
    def data_offset(self) -> int:
        """Where slot 0 starts (page aligned)."""
        _, fmt, count, at = self.columns()[-1]
        return _round_up(at + struct.calcsize(fmt) * count, _PAGE)

    @property
    def file_size(self) -> int:
        return self.data_offset + self.slot_count * self.slot_size

    def encode(self, fingerprint: str, flags: int) -> bytes:
        """The header page of a new arena (counters zero); `flags`: 0 or LOCKED_READS."""
        digest = entry.fingerprint_digest(fingerprint)
        fp = fingerprint.encode()
        if _FP_OFFSET + 2 + len(fp) > _PAGE:
            raise ValueError("fingerprint too long for an arena header")
        sizes = (self.payload_bytes, self.slot_size, self.slot_count, self.table_size)
        body = _HEADER.pack(MAGIC, VERSION, flags, digest, *sizes)
        page = bytearray(_PAGE)
        page[: _HEADER.size] = body
        _HEADER_XXH.pack_into(page, _HEADER.size, xxhash.xxh3_64_intdigest(body))
        struct.pack_into(f"<H{len(fp)}s", page, _FP_OFFSET, len(fp), fp)
        return bytes(page)

    @classmethod
    def decode(cls, page: bytes) -> ArenaHeader:
        """The header of an arena's first page; ArenaGeometryError if it is not one."""
        if len(page) < _PAGE:
            raise ArenaDamagedError("file too short for an arena header")
        body = page[: _HEADER.size]
        (xxh,) = _HEADER_XXH.unpack_from(page, _HEADER.size)
        magic, version, flags, digest, payload, slot_size, slots, table = _HEADER.unpack(body)
        if magic == MAGIC and version != VERSION:  # version 1: slot states in Python, no flags
            raise ArenaGeometryError(
                f"arena of layout version {version}, this pdserve uses {VERSION}: stop its"
                " users and remove the file to recreate it"
            )
        if magic != MAGIC or xxh != xxhash.xxh3_64_intdigest(body):
            raise ArenaDamagedError("not a pdserve arena (bad magic or checksum)")
        (n,) = struct.unpack_from("<H", page, _FP_OFFSET)
        fingerprint = page[_FP_OFFSET + 2 : _FP_OFFSET + 2 + n].decode(errors="replace")
        geometry = cls(payload, slots)
        if (slot_size, table) != (geometry.slot_size, geometry.table_size):
            raise ArenaDamagedError("inconsistent arena header")
        if entry.fingerprint_digest(fingerprint) != digest:
            raise ArenaDamagedError("arena header fingerprint does not match its digest")
        return ArenaHeader(geometry, fingerprint, bool(flags & LOCKED_READS))


class ArenaHeader(NamedTuple):
    """What an arena's header page holds: its geometry, its fingerprint, and whether its
    reads take the lock (`LockedSlots`) rather than run lock-free (`AtomicSlots`)."""

    geometry: Geometry
    fingerprint: str
    locked_reads: bool


def arena_path(fingerprint: str, base: str | os.PathLike[str] = DEFAULT_BASE) -> Path:
    """The arena file of a fingerprint under `base`."""
    return Path(base) / (entry.fingerprint_digest(fingerprint).hex() + SUFFIX)


def read_fingerprint(path: str | os.PathLike[str]) -> str:
    """The fingerprint an arena file holds (for `list_fingerprints`)."""
    with open(path, "rb") as f:
        return Geometry.decode(f.read(_PAGE)).fingerprint


def names_file(path: Path, fd: int) -> bool:
    """Whether `path` still names the file open as `fd` (not removed or replaced)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def key_digest(key: str) -> tuple[int, int]:
    """The 128-bit table key of a store key, as two u64."""
    d0, d1 = struct.unpack("<QQ", hashlib.blake2b(key.encode(), digest_size=16).digest())
    return d0, d1


def pid_namespace() -> int:
    """Inode of this process's pid namespace (0 if unknown): pids compare only within one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino & 0xFFFFFFFF
    except OSError:
        return 0


def owner_alive(owner: int, our_namespace: int) -> bool:
    """Whether the writer `owner` (pid namespace << 32 | pid) may still be running. Owners in
    another (or an unknown) pid namespace count as alive: only their age can reclaim them."""
    pid, namespace = owner & 0xFFFFFFFF, owner >> 32
    if namespace == 0 or namespace != our_namespace:
        return True
    if not 0 < pid <= _PID_MAX:  # damaged metadata (and kill(0) would signal our own group)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is dead for our purpose
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


class ArenaMapping:
    """The mmap of an arena and typed views of its parts: numpy arrays for vector work and
    copies, memoryview casts for scalar access (several times faster per element); the index
    table on top of them, and `slots`, the arena's slot protocol over its slot columns.

    `find` and `committed` take no lock when `slots` reads lock-free (a racy read is at worst a
    miss). Every other method writes shared metadata: its caller holds the arena lock."""

    def __init__(self, fd: int, geometry: Geometry, lib: ctypes.PyDLL | None) -> None:
        """`lib`: the C slot protocol (`AtomicSlots`), or None for `LockedSlots`."""
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self.mm = mmap.mmap(fd, geometry.file_size, flags=flags)
        self.bytes = np.frombuffer(self.mm, np.uint8)
        self.view = memoryview(self.mm)
        self.counters = self.view[64:128].cast("Q")
        self.np: dict[str, np.ndarray] = {}
        self.mv: dict[str, memoryview] = {}
        for name, fmt, count, start in geometry.columns():
            end = start + struct.calcsize(fmt) * count
            self.np[name] = self.bytes[start:end].view(fmt)
            self.mv[name] = self.view[start:end].cast(fmt)  # type: ignore[call-overload]
        self._slots, self._table_size = geometry.slot_count, geometry.table_size
        self._mask = self._table_size - 1
        self.slots = AtomicSlots(lib, self.np) if lib else LockedSlots(self.mv, self.np)

    # -- table (the open-addressing index) ------------------------------------------------------

    def find(self, d0: int, d1: int) -> int:
        """The slot the table maps the key to, -1 if none. Lock-free (racy reads are fine)."""
        tslot, tkey0, tkey1 = self.mv["tslot"], self.mv["tkey0"], self.mv["tkey1"]
        i = d0 & self._mask
        for _ in range(self._table_size):
            cell = tslot[i]
            if cell == _EMPTY:
                return -1
            if cell != _TOMB and tkey0[i] == d0 and tkey1[i] == d1:
                return cell - 1 if cell <= self._slots else -1
            i = (i + 1) & self._mask
        return -1

    def table_put(self, d0: int, d1: int, slot: int) -> int:
        """Map the key to `slot`; returns the slot it was mapped to before, or -1 (a new cell,
        counted in the `_TABLE_USED` counter unless it reuses a tombstone)."""
        tslot, tkey0, tkey1 = self.mv["tslot"], self.mv["tkey0"], self.mv["tkey1"]
        i, reuse = d0 & self._mask, -1
        for _ in range(self._table_size):
            cell = tslot[i]
            if cell == _EMPTY:
                break
            if cell == _TOMB:
                reuse = i if reuse < 0 else reuse
            elif tkey0[i] == d0 and tkey1[i] == d1:
                tslot[i] = slot + 1
                return cell - 1 if cell <= self._slots else -1
            i = (i + 1) & self._mask
        if reuse < 0:
            reuse = i
            self.count(_TABLE_USED, 1)
        tkey0[reuse], tkey1[reuse] = d0, d1
        tslot[reuse] = slot + 1  # last: a reader sees the cell only once its key is there
        return -1

    def table_remove(self, d0: int, d1: int, slot: int) -> None:
        """Tombstone the key's cell if it maps to `slot`."""
        tslot, tkey0, tkey1 = self.mv["tslot"], self.mv["tkey0"], self.mv["tkey1"]
        i = d0 & self._mask
        for _ in range(self._table_size):
            cell = tslot[i]
            if cell == _EMPTY:
                return
            if cell == slot + 1 and tkey0[i] == d0 and tkey1[i] == d1:
                tslot[i] = _TOMB
                return
            i = (i + 1) & self._mask

    def clear_table(self) -> None:
        """Empty every cell (tombstones included)."""
        for name in ("tslot", "tkey0", "tkey1"):
            self.np[name][:] = 0
        self.counters[_TABLE_USED] = 0

    def rebuild_table(self) -> None:
        """Drop the tombstones: re-insert every committed slot (readers miss meanwhile)."""
        self.clear_table()
        mv = self.mv
        for slot in np.flatnonzero(self.np["state"] == COMMITTED).tolist():
            d0, d1 = mv["key0"][slot], mv["key1"][slot]
            displaced = self.table_put(d0, d1, slot)
            if displaced >= 0:  # two slots of one key (a crash mid-publish): keep one
                self.free_if_holds(displaced, d0, d1)

    def count(self, counter: int, n: int) -> None:
        """Add `n` to a shared counter, modulo 2**64 (a damaged counter never raises)."""
        self.counters[counter] = (self.counters[counter] + n) & _U64

    # -- damage ---------------------------------------------------------------------------------

    def damage(self) -> list[str]:
        """What is wrong with the shared metadata (a vectorised look over every slot and table
        cell, under the arena lock): slots in no known state are lost to the CLOCK hand, table
        cells that name no slot would be probed forever, counters out of range. The entries
        themselves are checked on every read (checksums) and need no look here."""
        found = []
        if bad := int(np.count_nonzero(self.np["state"] > COMMITTED)):
            found.append(f"{bad} slots in no known state")
        if bad := int(np.count_nonzero(self.np["gen"] >= _GEN_LIMIT)):
            found.append(f"{bad} slots whose generation no reader can hold")
        tslot = self.np["tslot"]
        if bad := int(np.count_nonzero((tslot > self._slots) & (tslot != _TOMB))):
            found.append(f"{bad} table cells that name no slot")
        if self.counters[_HAND] >= self._slots or self.counters[_TABLE_USED] > self._table_size:
            found.append("counters out of range")
        return found

    def repair(self) -> None:
        """Free the slots in no known state, rebuild the table from the slots' own keys, bring
        the counters back in range. Under the arena lock."""
        gens = self.np["gen"]
        bad_gen = gens >= _GEN_LIMIT
        gens[bad_gen] = 0  # then freed: the generation moves on from there
        for slot in np.flatnonzero(bad_gen | (self.np["state"] > COMMITTED)).tolist():
            self.slots.free(slot)
        self.counters[_HAND] %= self._slots
        self.rebuild_table()

    # -- slot states (through the protocol) -----------------------------------------------------

    def committed(self, d0: int, d1: int) -> int:
        """The COMMITTED slot that holds the key, -1 if none."""
        slot = self.find(d0, d1)
        return slot if slot >= 0 and self.slots.read_begin(slot, d0, d1) >= 0 else -1

    def free_if_holds(self, slot: int, d0: int, d1: int) -> None:
        """Free `slot` if it is the committed slot of key (d0, d1) (a stale table cell may name
        a slot that now belongs to someone else)."""
        mv = self.mv
        if (
            slot >= 0
            and mv["state"][slot] == COMMITTED
            and (mv["key0"][slot], mv["key1"][slot]) == (d0, d1)
        ):
            self.slots.free(slot)

    def free_all(self) -> int:
        """Free every COMMITTED slot (WRITING ones are left to their writers), empty the table,
        put the CLOCK hand back at slot 0; returns how many slots were freed."""
        committed = np.flatnonzero(self.np["state"] == COMMITTED).tolist()
        for slot in committed:
            self.slots.free(slot)
        self.clear_table()
        self.counters[_HAND] = 0
        return len(committed)

    def close(self) -> None:
        for view in (*self.mv.values(), self.counters, self.view):
            view.release()
        self.np.clear()
        del self.bytes
        with contextlib.suppress(BufferError):  # a stray numpy view: the GC unmaps it later
            self.mm.close()


# -- opening --------------------------------------------------------------------------------------


class OpenArena(NamedTuple):
    """An arena opened by `open_arena`; the caller owns (closes) `fd` and `mapping`."""

    fd: int
    geometry: Geometry
    mapping: ArenaMapping


def open_arena(
    path: Path,
    fingerprint: str,
    payload_bytes: int | None,
    capacity_bytes: int | None,
    *,
    locked_reads: bool = False,
) -> OpenArena:
    """Open (creating it if missing), check and map the arena at `path`; ArenaGeometryError if
    it holds another fingerprint or geometry than asked (None: take the file's).

    A damaged file (`ArenaDamagedError`: a bad header, a truncated file) is replaced by a fresh,
    empty arena when `payload_bytes` says how to make one; entries are only a cache, and a node
    that crash-looped on a damaged arena would stop the cluster. A new arena reads lock-free
    (`AtomicSlots`) if the C slot protocol builds here and `locked_reads` is False, else under
    the lock (`LockedSlots`); an existing one keeps its own mode. ArenaProtocolError if it reads
    lock-free and this process cannot follow."""
    lib = None if locked_reads else load_library()
    flags = 0 if lib is not None else LOCKED_READS
    for _ in range(3):  # a replacement made by another process may be replaced again, rarely
        fd = _open_or_create(path, fingerprint, payload_bytes, capacity_bytes, flags)
        try:
            try:
                header = _check_header(fd, fingerprint, payload_bytes, capacity_bytes)
            except ArenaDamagedError as exc:
                if payload_bytes is None:
                    raise ArenaDamagedError(
                        f"arena {path}: {exc} (payload_bytes is needed to replace it)"
                    ) from None
                _replace_damaged(path, fd, fingerprint, payload_bytes, capacity_bytes, flags, exc)
                os.close(fd)
                continue
            if not header.locked_reads and lib is None:
                why = "locked reads were asked" if locked_reads else load_error()
                raise ArenaProtocolError(
                    f"arena {path} is read lock-free through the C slot protocol, which this"
                    f" process cannot run ({why}); remove the arena (all its users stopped) to"
                    " recreate it with locked reads"
                )
            mapping = ArenaMapping(fd, header.geometry, None if header.locked_reads else lib)
            return OpenArena(fd, header.geometry, mapping)
        except BaseException:
            os.close(fd)
            raise
    raise ArenaDamagedError(f"arena {path} was still damaged after three replacements")


def _open_or_create(
    path: Path, fingerprint: str, payload_bytes: int | None, capacity_bytes: int | None, flags: int
) -> int:
    """An O_RDWR fd of the arena at `path`, creating it if it does not exist."""
    with contextlib.suppress(FileNotFoundError):
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    if payload_bytes is None:
        raise ArenaGeometryError(f"no arena at {path}; payload_bytes is needed to create one")
    return _create(path, fingerprint, payload_bytes, capacity_bytes, flags, replace=False)


def _create(
    path: Path,
    fingerprint: str,
    payload_bytes: int,
    capacity_bytes: int | None,
    flags: int,
    *,
    replace: bool,
) -> int:
    """Make a new arena (fully allocated, header written) under a temporary name, then link it
    into place, so no process ever maps a half-made arena: beside nothing (`replace` False; if
    another process created one first, theirs is used) or over what is there. Returns an fd."""
    if not path.parent.exists():
        make_private_dir(path.parent)
    if capacity_bytes is None:
        capacity_bytes = default_capacity(path.parent)
    geometry = Geometry.for_capacity(payload_bytes, capacity_bytes)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.posix_fallocate(fd, 0, geometry.file_size)  # ENOSPC now, not SIGBUS later
        os.pwrite(fd, geometry.encode(fingerprint, flags), 0)
        if replace:
            os.replace(temp, path)
            return fd
        try:
            os.link(temp, path)
        except FileExistsError:  # another process created it first: use theirs
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        return fd
    except BaseException:
        os.close(fd)
        raise
    finally:
        temp.unlink(missing_ok=True)


def _replace_damaged(
    path: Path,
    fd: int,
    fingerprint: str,
    payload_bytes: int,
    capacity_bytes: int | None,
    flags: int,
    why: Exception,
) -> None:
    """Put a fresh arena in place of the damaged file open as `fd`, unless another process
    already has (the arena lock makes that check and the replacement one step). Processes that
    still map the old file move to the new one at their next file check (`ArenaStore`)."""
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        if not names_file(path, fd):
            return
        os.close(_create(path, fingerprint, payload_bytes, capacity_bytes, flags, replace=True))
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
    logger.warning("arena %s was damaged (%s): replaced by a fresh, empty arena", path, why)


def _check_header(
    fd: int, fingerprint: str, payload_bytes: int | None, capacity_bytes: int | None
) -> ArenaHeader:
    """The arena's header, after checking it against the file and what the caller asked."""
    header = Geometry.decode(os.pread(fd, _PAGE, 0))
    geometry, stored = header.geometry, header.fingerprint
    if stored != fingerprint:
        raise ArenaGeometryError(f"arena holds fingerprint {stored!r}, not {fingerprint!r}")
    if os.fstat(fd).st_size != geometry.file_size:
        raise ArenaDamagedError("arena file size does not match its header")
    if payload_bytes is not None and payload_bytes != geometry.payload_bytes:
        raise ArenaGeometryError(
            f"arena geometry mismatch: it holds {geometry.payload_bytes} B payloads,"
            f" {payload_bytes} B asked (delete the arena file to change it)"
        )
    if capacity_bytes is not None:
        asked = Geometry.for_capacity(geometry.payload_bytes, capacity_bytes).slot_count
        if asked != geometry.slot_count:
            raise ArenaGeometryError(
                f"arena geometry mismatch: it has {geometry.slot_count} slots, {asked} asked"
            )
    return header
