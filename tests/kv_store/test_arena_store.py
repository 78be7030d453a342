"""ArenaStore in a temp dir: round trips, verification, seqlock reads, CLOCK eviction order,
reclaim of dead writers, geometry checks, permissions, and real processes sharing one arena."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import random
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kv_store import HEADER_SIZE, ArenaStore, entry, open_store
from kv_store import arena_store as arena_module
from kv_store.arena_slots import load_library
from kv_store.arena_store import COMMITTED, FREE, WRITING, ArenaGeometryError, arena_path
from tests.kv_store import block_key, payload_for

FP = "tiny-llama|float32|bs16|L4|kv2|d32"
ENTRY = 1000  # payload bytes
SLOT = 1088  # HEADER_SIZE + ENTRY rounded up to 64


def _open(path: Path, slots: int = 64, payload: int = ENTRY, **kw: Any) -> ArenaStore:
    slot = -(-(HEADER_SIZE + payload) // 64) * 64
    return ArenaStore(path, FP, payload_bytes=payload, capacity_bytes=slots * slot, **kw)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return arena_path(FP, tmp_path / "base")


@pytest.fixture
def store(path: Path) -> Iterator[ArenaStore]:
    with _open(path) as s:
        yield s


def _put(store: ArenaStore, keys: list[str], num_tokens: int = 16) -> list[bool]:
    size = store.payload_bytes
    return store.put_many(keys, [payload_for(k, size) for k in keys], [num_tokens] * len(keys))


def _read(store: ArenaStore, keys: list[str], num_tokens: int = 16, size: int = 0) -> list[bool]:
    """get_many_into; asserts every hit holds exactly the key's payload."""
    size = size or store.payload_bytes
    out = [memoryview(bytearray(size)) for _ in keys]
    found = store.get_many_into(keys, [num_tokens] * len(keys), out)
    for key, hit, buf in zip(keys, found, out):
        assert not hit or buf.tobytes() == payload_for(key, size), key
    return found


def _chunks(data: bytes, cuts: list[int]) -> list[memoryview]:
    view = memoryview(data)
    edges = [0, *cuts, len(data)]
    return [view[a:b] for a, b in itertools.pairwise(edges)]


def _slot_offset(store: ArenaStore, key: str) -> int:
    slot = store.slot_of(key)
    assert slot >= 0
    return store.geometry.data_offset + slot * store.geometry.slot_size


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))


@pytest.mark.parametrize("size", [1, 4096, 32768 + 64, 2 << 20])
def test_round_trip(tmp_path: Path, size: int) -> None:
    with _open(arena_path(FP, tmp_path), slots=8, payload=size) as s:
        keys = [block_key(FP, i) for i in range(4)]
        assert _put(s, keys) == [True] * 4
        assert _read(s, keys) == [True] * 4
        assert s.get_many(keys, [16] * 4) == [payload_for(k, size) for k in keys]
        assert s.get_many([*keys[:1], "absent"], [16, 16]) == [payload_for(keys[0], size), None]


def test_chunks_in_and_out(store: ArenaStore) -> None:
    keys = [block_key(FP, i) for i in range(3)]
    payloads = [payload_for(k, ENTRY) for k in keys]
    chunked = [_chunks(p, [100, 100, 900]) for p in payloads]  # an empty chunk too
    assert store.put_many(keys, chunked, [16] * 3) == [True] * 3
    outs = [[memoryview(bytearray(n)) for n in (500, 500)] for _ in keys]
    assert store.get_many_into(keys, [16] * 3, outs) == [True] * 3
    assert [b"".join(c.tobytes() for c in out) for out in outs] == payloads
    with pytest.raises(ValueError):  # every payload of an arena has its size
        store.put_many([keys[0]], [payloads[0][:-1]], [16])


def test_contains_delete_and_overwrite(store: ArenaStore) -> None:
    keys = [block_key(FP, i) for i in range(6)]
    _put(store, keys[::2])
    assert store.contains_many(keys) == [i % 2 == 0 for i in range(6)]
    new = bytes(range(256)) * 3 + bytes(ENTRY - 768)
    slot = store.slot_of(keys[0])
    assert store.put_many([keys[0]], [new], [3]) == [True]  # overwritten in place
    assert store.get_many([keys[0]], [3]) == [new] and store.slot_of(keys[0]) == slot
    assert store.stats().entries == 3
    assert store.delete_many([keys[0], keys[1]]) == 1
    assert store.contains_many(keys[:3]) == [False, False, True]
    stats = store.stats()
    assert (stats.entries, stats.bytes, stats.evictions) == (2, 2 * (HEADER_SIZE + ENTRY), 0)


def test_repeated_key_in_a_batch_keeps_the_last(store: ArenaStore) -> None:
    key = block_key(FP, 0)
    first, last = bytes(ENTRY), bytes([7]) * ENTRY
    assert store.put_many([key, key], [first, last], [16, 16]) == [True, True]
    assert store.get_many([key], [16]) == [last] and store.stats().entries == 1


@pytest.mark.parametrize("offset", [0, 6, 20, 40, 63, HEADER_SIZE, HEADER_SIZE + ENTRY - 1])
def test_corrupt_slot_is_a_miss(store: ArenaStore, path: Path, offset: int) -> None:
    key = block_key(FP, 0)
    _put(store, [key])
    _flip(path, _slot_offset(store, key) + offset)  # another process's view of the pages
    assert _read(store, [key]) == [False]
    assert store.get_many([key], [16]) == [None]


def test_foreign_fingerprint_token_count_or_size_is_a_miss(store: ArenaStore, path: Path) -> None:
    key = block_key(FP, 0)
    _put(store, [key])
    assert _read(store, [key], num_tokens=15) == [False]
    assert _read(store, [key], size=ENTRY - 1) == [False]
    assert _read(store, [key]) == [True]
    payload = payload_for(key, ENTRY)  # a valid entry of another fingerprint in the same slot
    foreign = entry.encode_header(entry.fingerprint_digest("other-model"), 16, payload)
    with open(path, "r+b") as f:
        f.seek(_slot_offset(store, key))
        f.write(foreign)
    assert _read(store, [key]) == [False]


class _NumpyCopyHook:
    """`np` for arena_store whose copyto runs `hook` after each copy (once, not re-entrant)."""

    def __init__(self, hook: Callable[[], None]) -> None:
        self._hook: Callable[[], None] | None = hook

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def copyto(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)
        hook, self._hook = self._hook, None
        if hook is not None:
            hook()


@pytest.mark.skipif(
    load_library() is None, reason="lock-free reads only (under the lock, the hook would wait)"
)
def test_slot_recycled_during_a_read_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    k0, k1 = block_key(FP, 0), block_key(FP, 1)
    with _open(arena_path(FP, tmp_path), slots=1) as s:
        _put(s, [k0])

        def recycle() -> None:  # between the copy and the generation check
            assert s.delete_many([k0]) == 1
            assert _put(s, [k1]) == [True]  # the same (only) slot: a complete, valid entry

        monkeypatch.setattr(arena_module, "np", _NumpyCopyHook(recycle))
        assert _read(s, [k0]) == [False]
        monkeypatch.undo()
        assert _read(s, [k0, k1]) == [False, True]


def test_rewrite_unseen_by_the_generation_is_still_a_miss(tmp_path: Path) -> None:
    """Belt and braces: a writer that outlived its claim (reclaimed as stale) and writes another
    key's complete, valid entry over a reused slot does not bump the generation; the checksum
    the slot's publisher recorded still rejects the bytes."""
    k0, k1 = block_key(FP, 0), block_key(FP, 1)
    with _open(arena_path(FP, tmp_path), slots=1) as s:
        _put(s, [k0])
        slot = s.slot_of(k0)
        gen = s._map.mv["gen"][slot]
        s._write_slot(slot, [memoryview(payload_for(k1, ENTRY))], 16)  # the zombie's write
        assert s._map.mv["gen"][slot] == gen and s.slot_of(k0) == slot
        assert _read(s, [k0]) == [False]


def test_a_torn_read_is_a_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked reads are one preadv: here another key's bytes land between its first chunk and
    the rest, without a generation change (a writer that outlived its claim)."""
    k0, k1 = block_key(FP, 0), block_key(FP, 1)
    with _open(arena_path(FP, tmp_path), slots=1) as s:
        _put(s, [k0])
        tail = s.geometry.data_offset + HEADER_SIZE + 500
        preadv = os.preadv

        def torn_preadv(fd: int, bufs: list[memoryview], offset: int) -> int:
            n = preadv(fd, bufs[:2], offset)  # the header and the first chunk
            s._map.bytes[tail : tail + 500] = np.frombuffer(payload_for(k1, ENTRY)[500:], np.uint8)
            return n + preadv(fd, bufs[2:], offset + n)

        monkeypatch.setattr(os, "preadv", torn_preadv)
        out = [memoryview(bytearray(500)), memoryview(bytearray(500))]
        assert s.get_many_into([k0], [16], [out]) == [False]


def test_read_errors_are_misses(store: ArenaStore, monkeypatch: pytest.MonkeyPatch) -> None:
    key = block_key(FP, 0)
    _put(store, [key])

    def fail(*args: object) -> int:
        raise OSError("EIO")

    monkeypatch.setattr(os, "preadv", fail)
    out = [memoryview(bytearray(500)), memoryview(bytearray(500))]
    assert store.get_many_into([key], [16], [out]) == [False]
    assert store.stats().errors == 1
    assert _read(store, [key]) == [True]  # one buffer: copied from the mapping


def test_clock_eviction_order(tmp_path: Path) -> None:
    k = [block_key(FP, i) for i in range(8)]
    with _open(arena_path(FP, tmp_path), slots=4) as s:
        assert _put(s, k[:4]) == [True] * 4  # slots 0 1 2 3, hand back at 0
        assert _read(s, [k[0]]) == [True]  # reference bit of slot 0
        assert _put(s, [k[4]]) == [True]  # slot 0 gets a second chance; k1 (slot 1) evicted
        assert [s.slot_of(x) for x in k[:5]] == [0, -1, 2, 3, 1]
        assert _read(s, [k[2], k[5]]) == [True, False]  # reference bit of slot 2
        assert _put(s, [k[0]]) == [True]  # a present key is rewritten in place: no eviction
        assert s.stats().evictions == 1
        assert _put(s, k[5:7]) == [True, True]  # hand at 2: spares 2, evicts 3 (k3), 0 (k0)
        assert [s.slot_of(x) for x in k] == [-1, -1, 2, -1, 1, 3, 0, -1]
        stats = s.stats()
        assert (stats.entries, stats.bytes, stats.evictions) == (4, 4 * (HEADER_SIZE + ENTRY), 3)
        # A batch larger than the arena: k2 and k4 are rewritten in place, k0 and k1 take the
        # other two slots from the hand on (1: evicts k5, then k6), nothing is left for k3 (a
        # batch never evicts its own entries).
        assert _put(s, k[:5]) == [True, True, True, False, True]
        assert [s.slot_of(x) for x in k[:7]] == [3, 0, 2, -1, 1, -1, -1]


def test_table_survives_churn(tmp_path: Path) -> None:
    """Evictions leave tombstones; the table is rebuilt before they choke it."""
    keys = [block_key(FP, i) for i in range(400)]
    with _open(arena_path(FP, tmp_path), slots=16) as s:
        for i in range(0, 400, 8):
            assert _put(s, keys[i : i + 8]) == [True] * 8
        held = [k for k in keys if s.slot_of(k) >= 0]
        assert len(held) == 16 and held == keys[-16:]
        assert _read(s, keys) == [k in held for k in keys]
        assert s._map.counters[arena_module._TABLE_USED] * 4 <= s.geometry.table_size * 3


def test_parallel_batch_in_key_order(tmp_path: Path) -> None:
    size = 256 << 10  # entries large enough to be worth a thread
    keys = [block_key(FP, i) for i in range(12)]
    with _open(arena_path(FP, tmp_path), slots=16, payload=size, workers=3) as s:
        s._pool.min_slice_bytes = size  # split even this small batch
        assert _put(s, keys[::2]) == [True] * 6
        assert s._pool._executor is not None  # the batch did go through the threads
        assert _read(s, keys) == [i % 2 == 0 for i in range(12)]


def test_dead_writer_is_reclaimed(path: Path) -> None:
    with _open(path, slots=4) as s:
        _put(s, [block_key(FP, 0)])
        proc = mp.get_context("spawn").Process(target=_die_mid_put, args=(path,))
        proc.start()
        proc.join(30)
        assert proc.exitcode == 0
        state = s._map.np["state"]
        assert np.count_nonzero(state == WRITING) == 2  # the child's claims, never published
        assert s.reclaim() == 2
        assert np.count_nonzero(state == WRITING) == 0 and s.stats().entries == 1
        assert _put(s, [block_key(FP, i) for i in range(1, 4)]) == [True] * 3


def _die_mid_put(path: Path) -> None:
    """Child process: claims two slots, then dies while copying into the first."""
    store = ArenaStore(path, FP, workers=1)

    def die(*args: object) -> int:
        os._exit(0)

    store._write_slot = die  # type: ignore[method-assign]
    _put(store, [block_key(FP, 10), block_key(FP, 11)])


def test_stale_claims_are_reclaimed_by_age(store: ArenaStore) -> None:
    key = block_key(FP, 0)
    digest = store.key_digest(key)
    with store._locked():
        [(slot, gen)] = store._claim([digest])
    assert store.reclaim() == 0  # our own, fresh claim: alive
    foreign = (store._namespace + 1) << 32 | 1  # a writer in another pid namespace: alive?
    store._map.mv["owner"][slot] = foreign
    assert store.reclaim() == 0  # cannot tell, and young
    store._map.mv["stamp"][slot] -= int((arena_module.STALE_WRITE_S + 1) * 1e9)
    assert store.reclaim() == 1 and store._map.mv["state"][slot] == FREE
    with store._locked():  # the writer comes back: its publish must not commit
        assert store._publish([(digest, 0, slot, gen)], [123]) == {digest: False}
    assert store.contains_many([key]) == [False]


def test_a_removed_arena_is_followed(
    store: ArenaStore, path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator's rm while the servers run: each handle moves to a new arena at the path (its
    next operation after a second), so the processes do not stay split over two files."""
    old_inode = path.stat().st_ino
    path.unlink()
    with _open(path) as newcomer:  # a process started after the rm creates a new arena
        assert _put(newcomer, [block_key(FP, 1)]) == [True]
        store._next_file_check = 0  # the check runs at most once a second
        assert _put(store, [block_key(FP, 0)]) == [True]
        assert "removed or replaced while in use" in caplog.text
        assert path.stat().st_ino != old_inode
        assert _read(newcomer, [block_key(FP, 0)]) == [True]  # one file again
        assert _read(store, [block_key(FP, 1)]) == [True]


def test_geometry_is_checked(path: Path, tmp_path: Path) -> None:
    with pytest.raises(ArenaGeometryError, match="payload_bytes is needed"):
        ArenaStore(path, FP)
    _open(path, slots=8).close()
    with ArenaStore(path, FP) as s:  # an existing arena: geometry from its header
        assert (s.payload_bytes, s.geometry.slot_count) == (ENTRY, 8)
    with pytest.raises(ArenaGeometryError, match="1000 B payloads, 999 B asked"):
        ArenaStore(path, FP, payload_bytes=999)
    with pytest.raises(ArenaGeometryError, match="8 slots, 9 asked"):
        _open(path, slots=9)
    with pytest.raises(ArenaGeometryError, match="fingerprint"):
        ArenaStore(path, "other-model")
    junk = tmp_path / "junk.arena"
    junk.write_bytes(b"\0" * 8192)
    with pytest.raises(ArenaGeometryError, match="not a pdserve arena"):
        ArenaStore(junk, FP)
    with pytest.raises(ValueError, match="slots"):
        ArenaStore(tmp_path / "small.arena", FP, payload_bytes=ENTRY, capacity_bytes=SLOT - 1)


def test_stats_and_clear(store: ArenaStore) -> None:
    keys = [block_key(FP, i) for i in range(5)]
    _put(store, keys)
    _read(store, [*keys[:2], "absent"])
    stats = store.stats()
    assert (stats.entries, stats.bytes, stats.puts) == (5, 5 * (HEADER_SIZE + ENTRY), 5)
    assert (stats.gets, stats.hits, stats.shared_hits, stats.shared_misses) == (3, 2, 2, 1)
    assert store.clear() == 5
    assert (store.stats().entries, store.contains_many(keys)) == (0, [False] * 5)
    assert _read(store, keys) == [False] * 5
    assert _put(store, keys) == [True] * 5 and _read(store, keys) == [True] * 5


def test_hit_counts_shared_between_handles(store: ArenaStore, path: Path) -> None:
    keys = [block_key(FP, i) for i in range(2)]
    _put(store, keys)
    with ArenaStore(path, FP) as other:
        assert _read(other, keys) == [True, True]
        assert other.slot_of(keys[0]) == store.slot_of(keys[0])
    stats = store.stats()
    assert (stats.gets, stats.shared_hits, stats.shared_hit_rate) == (0, 2, 1.0)


def test_permissions(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # modes must not depend on the caller's umask
    try:
        with _open(arena_path(FP, tmp_path / "base"), slots=2) as s:
            _put(s, [block_key(FP, 0)])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE((tmp_path / "base").stat().st_mode) == 0o700
    assert [p.name for p in (tmp_path / "base").iterdir()] == [s.path.name]  # no temp file left
    assert stat.S_IMODE(s.path.stat().st_mode) == 0o600


def test_open_store_shm_url(tmp_path: Path) -> None:
    url = f"shm://{tmp_path}/kv?capacity=64KiB&workers=3"
    with open_store(url, FP, payload_bytes=ENTRY) as s:
        assert isinstance(s, ArenaStore)
        assert (s.workers, s.geometry.slot_count) == (3, 64 * 1024 // SLOT)
        assert s.path == arena_path(FP, tmp_path / "kv")
    with pytest.raises(ValueError, match="unknown URL parameters"):
        open_store(f"shm://{tmp_path}/kv?fsync=1", FP, payload_bytes=ENTRY)


def test_handle_refuses_to_cross_fork(store: ArenaStore) -> None:
    pid = os.fork()
    if pid == 0:  # child: the inherited flock description would not exclude the parent
        try:
            store.put_many(["k"], [bytes(ENTRY)], [1])
            os._exit(1)
        except RuntimeError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert _put(store, [block_key(FP, 0)]) == [True]


# -- several processes --------------------------------------------------------------------------

NUM_KEYS, DURATION_S, BATCH = 48, 1.5, 4


def _writer(path: Path, seed: int) -> int:
    """Put random batches (as chunks) for DURATION_S; returns how many puts succeeded."""
    rng, ok = random.Random(seed), 0
    keys = [block_key(FP, i) for i in range(NUM_KEYS)]
    with ArenaStore(path, FP) as store:
        deadline = time.monotonic() + DURATION_S
        while time.monotonic() < deadline:
            batch = rng.sample(keys, BATCH)
            payloads = [_chunks(payload_for(k, ENTRY), [rng.randrange(ENTRY)]) for k in batch]
            ok += sum(store.put_many(batch, payloads, [16] * BATCH))
    return ok


def _reader(path: Path, seed: int) -> tuple[int, int, int]:
    """Get random batches for DURATION_S; returns (hits, misses, hits with wrong bytes)."""
    rng, hits, misses, corrupt = random.Random(seed), 0, 0, 0
    keys = [block_key(FP, i) for i in range(NUM_KEYS)]
    with ArenaStore(path, FP) as store:
        deadline = time.monotonic() + DURATION_S
        while time.monotonic() < deadline:
            batch = rng.sample(keys, BATCH)
            out = [memoryview(bytearray(ENTRY)) for _ in batch]
            for key, hit, buf in zip(batch, store.get_many_into(batch, [16] * BATCH, out), out):
                hits, misses = hits + hit, misses + (not hit)
                corrupt += hit and buf.tobytes() != payload_for(key, ENTRY)
    return hits, misses, corrupt


def test_writers_and_readers_in_processes(path: Path) -> None:
    _open(path, slots=12).close()  # 48 keys through 12 slots: constant eviction
    ctx = mp.get_context("spawn")
    with ctx.Pool(4) as pool:
        writes = [pool.apply_async(_writer, (path, seed)) for seed in range(2)]
        reads = [pool.apply_async(_reader, (path, seed)) for seed in range(2)]
        puts = sum(w.get(60) for w in writes)
        hits, misses, corrupt = map(sum, zip(*(r.get(60) for r in reads)))
    assert corrupt == 0
    assert puts > 0 and hits > 0 and misses > 0  # the pressure was real
    with ArenaStore(path, FP) as store:
        assert np.count_nonzero(store._map.np["state"] == WRITING) == 0
        assert store.stats().entries == np.count_nonzero(store._map.np["state"] == COMMITTED)
        assert 0 < store.stats().entries <= 12 and store.stats().evictions > 0
        keys = [block_key(FP, i) for i in range(NUM_KEYS)]
        held = store.contains_many(keys)
        assert _read(store, keys) == held  # every mapped key reads back intact
