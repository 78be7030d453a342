"""FileStore in a temp dir: round trips (buffers and chunks), verification, two-phase commit, LRU
order, parallel batches and their index bookkeeping, permissions."""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from kv_store import HEADER_SIZE, FileStore, entry, file_store, open_store
from kv_store.file_store import default_root
from tests.kv_store import block_key, payload_for

FP = "tiny-llama|float32|bs16|L4|kv2|d32"
SIZES = [1, 100, 4096, 32768, 65536, 2 << 20]
ENTRY = 1000  # payload bytes in the capacity tests
FILE = HEADER_SIZE + ENTRY


@pytest.fixture
def store(tmp_path: Path) -> Iterator[FileStore]:
    with FileStore(tmp_path / "ns", FP, capacity_bytes=64 << 20) as s:
        yield s


def _put(store: FileStore, keys: list[str], size: int = ENTRY, num_tokens: int = 16) -> list[bool]:
    return store.put_many(keys, [payload_for(k, size) for k in keys], [num_tokens] * len(keys))


def _read(store: FileStore, keys: list[str], size: int = ENTRY, num_tokens: int = 16) -> list[bool]:
    """get_many_into; asserts every hit holds exactly the key's payload."""
    out = [memoryview(bytearray(size)) for _ in keys]
    found = store.get_many_into(keys, [num_tokens] * len(keys), out)
    for key, hit, buf in zip(keys, found, out):
        assert not hit or buf.tobytes() == payload_for(key, size), key
    return found


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(data)


@pytest.mark.parametrize("size", SIZES)
def test_round_trip(store: FileStore, size: int) -> None:
    keys = [block_key(FP, i) for i in range(4)]
    assert _put(store, keys, size) == [True] * 4
    assert _read(store, keys, size) == [True] * 4
    assert store.get_many(keys, [16] * 4) == [payload_for(k, size) for k in keys]
    assert store.path_of(keys[0]).stat().st_size == HEADER_SIZE + size


def test_contains_delete_and_overwrite(store: FileStore) -> None:
    keys = [block_key(FP, i) for i in range(6)]
    _put(store, keys[::2])
    assert store.contains_many(keys) == [i % 2 == 0 for i in range(6)]
    store.put_many([keys[0]], [b"new"], [3])  # overwrite: replaced, not double counted
    assert store.get_many([keys[0]], [3]) == [b"new"]
    assert store.stats().bytes == 2 * FILE + HEADER_SIZE + 3
    assert store.delete_many([keys[0], keys[1]]) == 1
    assert store.contains_many(keys[:3]) == [False, False, True]
    assert (store.stats().entries, store.stats().bytes) == (2, 2 * FILE)


@pytest.mark.parametrize("offset", [0, 6, 20, 40, 63, HEADER_SIZE, HEADER_SIZE + ENTRY - 1])
def test_corrupt_file_is_a_miss_and_removed(store: FileStore, offset: int) -> None:
    """A damaged entry is a miss, and it is removed (it was missed again on every request,
    and a producer never rewrote it: its name was there); the next save writes it again."""
    key = block_key(FP, 0)
    _put(store, [key])
    _flip(store.path_of(key), offset)
    assert _read(store, [key]) == [False]
    assert store.contains_many([key]) == [False] and store.stats().entries == 0
    _put(store, [key])
    _flip(store.path_of(key), offset)
    assert store.get_many([key], [16]) == [None]
    assert store.contains_many([key]) == [False]
    _put(store, [key])
    assert _read(store, [key]) == [True]


@pytest.mark.parametrize("read", ["into", "whole"])
def test_a_fifo_entry_is_a_miss_never_a_wait(store: FileStore, read: str) -> None:
    """A FIFO at an entry's name (a stalled shared filesystem, in the issue's repro) made open()
    wait for a writer forever, wedging the engine that read it: it is a miss at once now, and
    removed like any damaged entry, so the next save writes it again."""
    keys = [block_key(FP, i) for i in range(2)]
    _put(store, keys)
    path = store.path_of(keys[0])
    path.unlink()
    os.mkfifo(path)
    result: list[object] = []
    reader = threading.Thread(
        target=lambda: result.append(
            _read(store, keys) if read == "into" else store.get_many(keys, [16] * 2)
        ),
        daemon=True,
    )
    reader.start()
    reader.join(10.0)
    if reader.is_alive():  # unblock the reader (a writer opens the FIFO) before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("a read waited on a FIFO")
    hits = [r is True or isinstance(r, bytes) for r in result[0]]  # type: ignore[attr-defined]
    assert hits == [False, True]
    assert not path.exists() and store.contains_many(keys) == [False, True]
    _put(store, keys[:1])
    assert _read(store, keys) == [True, True]


def test_truncated_or_extended_file_is_a_miss(store: FileStore) -> None:
    keys = [block_key(FP, i) for i in range(2)]
    _put(store, keys)
    os.truncate(store.path_of(keys[0]), HEADER_SIZE + ENTRY - 1)
    with open(store.path_of(keys[1]), "ab") as f:
        f.write(b"extra")
    assert _read(store, keys) == [False, False]


def test_foreign_fingerprint_token_count_or_size_is_a_miss(store: FileStore) -> None:
    key = block_key(FP, 0)
    _put(store, [key])
    with FileStore(store.root, "other-model") as other:  # same directory, other fingerprint
        assert other.get_many_into([key], [16], [memoryview(bytearray(ENTRY))]) == [False]
    assert _read(store, [key], num_tokens=15) == [False]
    assert _read(store, [key], size=ENTRY - 1) == [False]
    assert _read(store, [key]) == [True]  # another reader's mismatch removes nothing


def test_half_written_entries_are_invisible(store: FileStore) -> None:
    key = block_key(FP, 0)
    payload = payload_for(key, ENTRY)
    # (1) a complete temp file whose rename never happened (writer died before committing)
    final = store.path_of(key)
    temp = final.parent / f".tmp-{final.name}-999999-0"
    temp.write_bytes(entry.encode_header(store._fp_digest, 16, payload) + payload)
    assert _read(store, [key]) == [False] and store.contains_many([key]) == [False]
    # (2) a file in place whose header was never committed (payload written, header not flipped)
    final.write_bytes(entry.encode_header(store._fp_digest, 16, payload, committed=False) + payload)
    assert _read(store, [key]) == [False]
    # (3) payload written, header still zeros
    final.write_bytes(bytes(HEADER_SIZE) + payload)
    assert _read(store, [key]) == [False]


def test_stale_temp_files_are_swept(tmp_path: Path) -> None:
    FileStore(tmp_path / "ns", FP).close()
    stale, fresh = tmp_path / "ns/ab/.tmp-x-1-0", tmp_path / "ns/ab/.tmp-y-1-0"
    stale.write_bytes(b"old")
    fresh.write_bytes(b"in flight")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    FileStore(tmp_path / "ns", FP).close()
    assert not stale.exists() and fresh.exists()


def test_lru_eviction_order(tmp_path: Path) -> None:
    k = [block_key(FP, i) for i in range(8)]
    with FileStore(tmp_path / "ns", FP, capacity_bytes=4 * FILE) as s:
        assert _put(s, k[:4]) == [True] * 4  # LRU order: 0 1 2 3
        assert _read(s, [k[0]]) == [True]  # 1 2 3 0
        assert _put(s, [k[4]]) == [True]  # evicts 1 → 2 3 0 4
        assert _read(s, [k[2], k[5]]) == [True, False]  # 3 0 4 2
        assert _put(s, [k[0]]) == [True]  # re-put of a present key evicts nothing → 3 4 2 0
        assert _put(s, k[5:7]) == [True, True]  # evicts 3, 4 → 2 0 5 6
        assert s.contains_many(k) == [True, False, True, False, False, True, True, False]
        stats = s.stats()
        assert (stats.entries, stats.bytes, stats.evictions) == (4, 4 * FILE, 3)
        assert _put(s, [k[7]], size=4 * FILE) == [False]  # can never fit
        assert s.reconcile() == (0, 0)


def test_capacity_shared_between_handles(tmp_path: Path) -> None:
    k = [block_key(FP, i) for i in range(6)]
    with (
        FileStore(tmp_path / "ns", FP, capacity_bytes=3 * FILE) as a,
        FileStore(tmp_path / "ns", FP, capacity_bytes=3 * FILE) as b,
    ):
        _put(a, k[:3])
        assert _read(b, [k[0]]) == [True]  # b's read protects k0 from a's next eviction
        _put(a, [k[3]])
        assert a.contains_many(k[:4]) == [True, False, True, True]
        stats = b.stats()
        assert (stats.entries, stats.bytes, stats.shared_hits) == (3, 3 * FILE, 1)
        assert (stats.gets, stats.hits) == (1, 1)  # per-handle counters


def test_permissions(tmp_path: Path) -> None:
    old_umask = os.umask(0)  # modes must not depend on the caller's umask
    try:
        with FileStore(tmp_path / "base" / "ns", FP) as s:
            _put(s, [block_key(FP, 0)])
            _read(s, [block_key(FP, 0)])
    finally:
        os.umask(old_umask)
    for path in [tmp_path / "base", *(tmp_path / "base").rglob("*")]:
        expected = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == expected, path


def test_default_root_is_per_fingerprint() -> None:
    root = default_root(FP)
    assert root.parent == Path("/dev/shm/pdserve")
    assert root.name == entry.fingerprint_digest(FP).hex() != default_root("x").name


def test_reconcile_repairs_index(store: FileStore) -> None:
    keys = [block_key(FP, i) for i in range(3)]
    _put(store, keys)
    os.unlink(store.path_of(keys[0]))  # file lost behind the index's back
    orphan = store.path_of(block_key(FP, 9))  # file the index never heard of
    orphan.write_bytes(store.path_of(keys[1]).read_bytes())
    assert store.reconcile() == (1, 1)
    assert store.reconcile() == (0, 0)
    assert store.stats().entries == 3


def test_clear(store: FileStore) -> None:
    _put(store, [block_key(FP, i) for i in range(5)])
    (store.root / "00" / ".tmp-x-1-0").write_bytes(b"junk")
    assert store.clear() == 6
    assert (store.stats().entries, store.stats().bytes) == (0, 0)
    assert not any(p.is_file() for p in store.root.glob("??/*"))


def test_unreadable_root_is_misses_not_exceptions(store: FileStore) -> None:
    key = block_key(FP, 0)
    _put(store, [key])
    store.path_of(key).unlink()
    store.path_of(key).mkdir()  # open() of a directory for reading fails with EISDIR
    assert _read(store, [key]) == [False]
    assert store.get_many([key], [16]) == [None]
    assert store.stats().errors == 2


def test_one_writer_one_reader_thread(tmp_path: Path) -> None:
    keys = [block_key(FP, i) for i in range(64)]
    errors: list[BaseException] = []
    with FileStore(tmp_path / "ns", FP, capacity_bytes=40 * FILE) as s:  # evicting all along

        def writer() -> None:
            for _ in range(5):
                for i in range(0, 64, 8):
                    _put(s, keys[i : i + 8])

        def reader() -> None:
            try:
                for _ in range(20):
                    _read(s, keys)  # every hit is checked byte for byte
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert s.stats().bytes <= 40 * FILE and s.reconcile() == (0, 0)


def test_handle_refuses_to_cross_fork(store: FileStore) -> None:
    pid = os.fork()
    if pid == 0:  # child: the inherited SQLite handle and flock must not be used
        try:
            store.put_many(["k"], [b"x"], [1])
            os._exit(1)
        except RuntimeError:
            os._exit(0)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert not list(store.root.glob("??/.tmp-*"))  # the child's staged file was cleaned up
    assert _put(store, [block_key(FP, 0)]) == [True]  # the parent's handle is unaffected


def _chunks(data: bytes, cuts: list[int]) -> list[memoryview]:
    edges = [0, *cuts, len(data)]
    return [memoryview(data)[a:b] for a, b in itertools.pairwise(edges)]


@pytest.mark.parametrize("size", [100, 65536, 2 << 20])
def test_chunks_in_and_out(store: FileStore, size: int) -> None:
    keys = [block_key(FP, i) for i in range(3)]
    payloads = [payload_for(k, size) for k in keys]
    chunked = [_chunks(p, [size // 3, size // 3, size // 2]) for p in payloads]  # one empty
    assert store.put_many(keys, chunked, [16] * 3) == [True] * 3
    assert store.path_of(keys[0]).read_bytes()[HEADER_SIZE:] == payloads[0]
    outs = [[memoryview(bytearray(n)) for n in (size // 2, size - size // 2)] for _ in keys]
    assert store.get_many_into(keys, [16] * 3, outs) == [True] * 3
    assert [b"".join(c.tobytes() for c in out) for out in outs] == payloads
    short = [memoryview(bytearray(size // 2)), memoryview(bytearray(size - size // 2 - 1))]
    assert store.get_many_into(keys[:1], [16], [short]) == [False]  # chunks one byte short


def _parallel(store: FileStore) -> FileStore:
    store._pool.min_item_bytes = store._pool.min_slice_bytes = 0  # split every batch
    return store


def test_parallel_batches_keep_key_order_and_the_index(tmp_path: Path) -> None:
    size, keys = 64 << 10, [block_key(FP, i) for i in range(24)]
    entry_file = HEADER_SIZE + size
    with _parallel(FileStore(tmp_path / "ns", FP, capacity_bytes=10 * entry_file, workers=3)) as s:
        assert _put(s, keys[:12:2], size) == [True] * 6
        assert s._pool._executor is not None  # the batch did go through the threads
        assert _read(s, keys[:12], size) == [i % 2 == 0 for i in range(12)]
        assert _put(s, keys[12:20], size) == [True] * 8  # evicts the 4 least recently read
        assert s.contains_many(keys[:12]) == [i in (8, 10) for i in range(12)]
        assert _put(s, keys[12:], size) == [True] * 10 + [False] * 2  # only 10 ever fit
        assert s.contains_many(keys) == [False] * 12 + [True] * 10 + [False] * 2
        stats = s.stats()
        assert (stats.entries, stats.bytes) == (10, 10 * entry_file)
        assert s.reconcile() == (0, 0)
        files = list(s.root.glob("??/*"))
        assert len(files) == 10 and sum(f.stat().st_size for f in files) == stats.bytes


def test_eviction_between_reserve_and_rename(tmp_path: Path) -> None:
    """Another process evicts (here: deletes) an entry after its writer reserved it but before
    the rename: settling the batch removes the file, so the directory agrees with the index."""
    keys = [block_key(FP, i) for i in range(2)]
    with FileStore(tmp_path / "ns", FP) as a, FileStore(tmp_path / "ns", FP) as b:
        write = a._write_entry

        def racing_write(name: str, chunks: list[memoryview], num_tokens: int) -> bool:
            if name == a.entry_name(keys[0]):
                assert b.delete_many([keys[0]]) == 0  # drops the row; no file yet
            return write(name, chunks, num_tokens)

        a._write_entry = racing_write  # type: ignore[method-assign]
        assert _put(a, keys) == [True, True]  # durable when put; gone since (like an eviction)
        assert a.contains_many(keys) == [False, True]
        assert (a.stats().entries, a.reconcile()) == (1, (0, 0))


def test_failed_write_drops_its_reservation(store: FileStore) -> None:
    keys = [block_key(FP, i) for i in range(3)]
    _put(store, keys[:1])

    def fail(name: str, chunks: list[memoryview], num_tokens: int) -> bool:
        return False

    store._write_entry = fail  # type: ignore[method-assign]
    assert _put(store, keys) == [False] * 3  # a re-put of keys[0] fails: its old file stays
    assert store.contains_many(keys) == [True, False, False]
    assert (store.stats().entries, store.stats().bytes, store.reconcile()) == (1, FILE, (0, 0))


def test_file_url_options(tmp_path: Path) -> None:
    with open_store(f"file://{tmp_path}?workers=3&capacity=1MiB", FP, payload_bytes=7) as s:
        assert isinstance(s, FileStore)
        assert (s.workers, s.capacity_bytes) == (3, 1 << 20)
        assert _put(s, [block_key(FP, 0)]) == [True]  # payload_bytes is the arena's business


class _StatVFS(NamedTuple):
    f_frsize: int
    f_blocks: int
    f_bavail: int


@pytest.mark.parametrize(
    "size_gib, free_gib, expected_gib",
    [
        (100, 2, 0.5),  # a nearly full disk: a quarter of what is free, not of its size
        (24, 20, 4),  # RAM-backed /dev/shm on a 24 GiB box: capped (was 6 GiB)
        (1000, 900, 4),
    ],
)
def test_default_capacity_is_a_capped_share_of_free_space(
    monkeypatch, tmp_path, caplog, size_gib, free_gib, expected_gib
):
    gib = 2**30
    monkeypatch.setattr(
        file_store.os,
        "statvfs",
        lambda _: _StatVFS(4096, size_gib * gib // 4096, free_gib * gib // 4096),
    )
    with caplog.at_level(logging.INFO, logger=file_store.__name__):
        assert file_store.default_capacity(tmp_path) == int(expected_gib * gib)
    assert "?capacity=" in caplog.text  # one line says what it took and how to change it


def test_a_store_directory_removed_while_serving_is_made_again(store: FileStore) -> None:
    """An operator's ``rm -r`` of the namespace under a running node: every later write failed
    with ENOENT until a restart (a shared prefill node in the test suite met it). Now the next
    write makes the directories again, 0700, and the store serves."""
    import shutil

    keys = [block_key(FP, i) for i in range(8)]
    assert _put(store, keys[:4]) == [True] * 4
    shutil.rmtree(store.root)
    assert _read(store, keys[:4]) == [False] * 4  # gone with the directory: misses
    assert _put(store, keys[4:]) == [True] * 4
    assert _read(store, keys[4:]) == [True] * 4
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
