"""The slot protocol of an arena: the state changes of a slot and the checks of a lock-free read,
in one of two modes chosen when the arena is opened (`slot_protocol`), the same for every
process that maps it (the arena's header records which).

- `AtomicSlots` (lock-free reads): the functions of ``csrc/arena_slots.c``, C11 atomics with
  acquire/release orderings on the slot state words; its comment states the argument. The C
  file is compiled on first use and cached (``common.native_build``); it is loaded through
  ctypes, with no torch.
- `LockedSlots` (every read under the arena lock): plain Python, for a machine with no C
  compiler. Nothing is read without the lock, so nothing depends on the order in which another
  CPU sees the stores: the lock (an flock, the kernel's) orders them, as a mutex would.

Both keep the same state words, so the layout and the writers' lock discipline are one. A slot's
generation is odd while it is WRITING and moves at every state change (`begin_write`, `commit`,
`free`): a reader that finds the same even generation before and after its copy copied the
bytes that generation published.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np

from common import native_build

logger = logging.getLogger(__name__)

FREE, WRITING, COMMITTED = 0, 1, 2
# The slot metadata columns, as arena_layout lays them out and the C struct takes them.
SLOT_COLUMNS = (("gen", "Q"), ("key0", "Q"), ("key1", "Q"), ("xxh", "Q"), ("stamp", "Q"),
                ("owner", "Q"), ("state", "B"), ("ref", "B"))  # fmt: skip

_CSRC = Path(__file__).with_name("csrc")
LIBRARY = native_build.NativeLibrary(
    name="pdserve_arena.so",
    cache_subdir="kv_store",
    sources=(native_build.Source(_CSRC / "arena_slots.c", ("-O2", "-fPIC", "-std=c11")),),
    include_dir=_CSRC,
)
_U64, _I64, _PTR = ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p
_PROTOTYPES = {  # C function -> (result type, argument types)
    "pdkv_read_begin": (_I64, [_PTR, _U64, _U64, _U64]),
    "pdkv_read_end": (ctypes.c_int, [_PTR, _U64, _U64]),
    "pdkv_begin_write": (_U64, [_PTR, _U64, _U64, _U64, _U64, _U64]),
    "pdkv_commit": (ctypes.c_int, [_PTR, _U64, _U64, _U64]),
    "pdkv_free": (None, [_PTR, _U64]),
    "pdkv_clock_scan": (_I64, [_PTR, _U64, _U64, _I64, _PTR, _PTR]),
}

_lock = threading.Lock()
_library: ctypes.PyDLL | None = None
_load_error: str | None = None


def load_library() -> ctypes.PyDLL | None:
    """The compiled slot protocol, building it on first use; None (logged once) if it cannot
    be built, and the caller opens arenas with `LockedSlots`."""
    global _library, _load_error
    with _lock:
        if _library is None and _load_error is None:
            try:
                _library = _bind(native_build.build(LIBRARY, native_build.compiler()))
            except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
                _load_error = str(exc).splitlines()[0]
                logger.warning(
                    "shm arena: no C slot protocol (%s); new arenas take a lock for every read"
                    " (correct, slower)", _load_error,
                )  # fmt: skip
        return _library


def load_error() -> str | None:
    """Why `load_library` returned None (after it was called)."""
    return _load_error


def _bind(path: Path) -> ctypes.PyDLL:
    lib = ctypes.PyDLL(str(path))  # keeps the GIL: each call is a few loads and stores
    for name, (restype, argtypes) in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class _SlotColumns(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name, _ in SLOT_COLUMNS]


class AtomicSlots:
    """The slot protocol of ``csrc/arena_slots.c`` over mapped columns (lock-free reads).

    `read_begin` / `read_end` take no lock; every other method is called under the arena lock.
    The columns (numpy views of the mapping) must outlive this object."""

    locked_reads = False

    def __init__(self, lib: ctypes.PyDLL, columns: dict[str, np.ndarray]) -> None:
        self._columns = _SlotColumns(*(columns[name].ctypes.data for name, _ in SLOT_COLUMNS))
        self._s = ctypes.addressof(self._columns)
        # The C functions bound to this arena's columns (partials: no Python frame per call,
        # which costs as much as the call itself). Their contracts, as `LockedSlots`':
        # read_begin(slot, d0, d1) -> the generation of `slot` if it is COMMITTED to the key,
        # else -1; read_end(slot, gen) -> nonzero if `slot` is still at `gen` (what was read
        # since read_begin is the key's), setting its reference bit; begin_write(slot, d0, d1,
        # owner, now) -> the odd generation of the new claim; commit(slot, gen, xxh) -> nonzero
        # if still claimed at `gen`, now COMMITTED; free(slot).
        self.read_begin: Callable[[int, int, int], int] = partial(lib.pdkv_read_begin, self._s)
        self.read_end: Callable[[int, int], int] = partial(lib.pdkv_read_end, self._s)
        self.begin_write: Callable[[int, int, int, int, int], int] = partial(
            lib.pdkv_begin_write, self._s
        )
        self.commit: Callable[[int, int, int], int] = partial(lib.pdkv_commit, self._s)
        self.free: Callable[[int], None] = partial(lib.pdkv_free, self._s)
        self._clock_scan = lib.pdkv_clock_scan

    def clock_scan(self, lo: int, hi: int, want: int) -> tuple[list[int], int]:
        """Up to `want` slots of [lo, hi) a claim may take (FREE, or COMMITTED with a clear
        reference bit), and where the hand stops; clears the bits of the slots passed."""
        out, end = np.empty(max(want, 1), np.int64), ctypes.c_uint64()
        n = self._clock_scan(self._s, lo, hi, want, out.ctypes.data, ctypes.addressof(end))
        return out[:n].tolist(), end.value


class LockedSlots:
    """The same protocol in Python, for arenas whose every read holds the arena lock (no C
    compiler): every method is called under the lock."""

    locked_reads = True

    def __init__(self, views: dict[str, memoryview], columns: dict[str, np.ndarray]) -> None:
        self._mv, self._np = views, columns

    def read_begin(self, slot: int, d0: int, d1: int) -> int:
        mv = self._mv
        gen = mv["gen"][slot]
        if gen & 1 or mv["state"][slot] != COMMITTED or mv["key0"][slot] != d0:
            return -1
        return gen if mv["key1"][slot] == d1 else -1

    def read_end(self, slot: int, gen: int) -> bool:
        if self._mv["gen"][slot] != gen:
            return False
        self._mv["ref"][slot] = 1
        return True

    def begin_write(self, slot: int, d0: int, d1: int, owner: int, now: int) -> int:
        mv = self._mv
        gen = mv["gen"][slot] + 1 | 1
        mv["gen"][slot], mv["state"][slot], mv["ref"][slot] = gen, WRITING, 0
        mv["key0"][slot], mv["key1"][slot] = d0, d1
        mv["owner"][slot], mv["stamp"][slot] = owner, now
        return gen

    def commit(self, slot: int, gen: int, xxh: int) -> bool:
        mv = self._mv
        if mv["gen"][slot] != gen:
            return False
        mv["xxh"][slot], mv["state"][slot], mv["gen"][slot] = xxh, COMMITTED, gen + 1
        return True

    def free(self, slot: int) -> None:
        self._mv["state"][slot] = FREE
        self._mv["gen"][slot] = (self._mv["gen"][slot] | 1) + 1

    def clock_scan(self, lo: int, hi: int, want: int) -> tuple[list[int], int]:
        state, ref = self._np["state"][lo:hi], self._np["ref"][lo:hi]
        usable = (state == FREE) | ((state == COMMITTED) & (ref == 0))
        found = np.flatnonzero(usable)[:want].tolist()
        end = lo + found[-1] + 1 if found and len(found) == want else hi
        self._np["ref"][lo:end] = 0
        return [lo + i for i in found], end
