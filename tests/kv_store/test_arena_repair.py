"""The arena repairs itself (issue 26, item 6): a damaged header or a truncated file is replaced
by a fresh arena when a process opens it (a node restarted onto a damaged arena starts, instead
of crash-looping), the handles still mapping the old file follow, and damaged shared metadata
(slots in no known state, garbage table cells, out-of-range counters or owner pids) costs misses,
never a failed save."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kv_store import ArenaStore
from kv_store.arena_layout import _PAGE, ArenaDamagedError, Geometry, pid_namespace
from kv_store.arena_slots import COMMITTED, FREE, WRITING
from kv_store.arena_store import arena_path
from tests.kv_store import block_key
from tests.kv_store.test_arena_store import ENTRY, FP, _open, _put, _read


def _keys(lo: int, hi: int) -> list[str]:
    return [block_key(FP, i) for i in range(lo, hi)]


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return arena_path(FP, tmp_path / "base")


def _magic(path: Path) -> None:
    _overwrite(path, 0, b"\xff" * 8)  # the fault campaign's repro


def _sizes(path: Path) -> None:
    _overwrite(path, 32, (12345).to_bytes(8, "little"))  # payload bytes, under the checksum


def _truncated(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _too_short(path: Path) -> None:
    os.truncate(path, 100)


@pytest.mark.parametrize("damage", [_magic, _sizes, _truncated, _too_short])
def test_a_damaged_file_is_replaced_when_opened(
    path: Path, damage: object, caplog: pytest.LogCaptureFixture
) -> None:
    with _open(path) as before:
        assert _put(before, _keys(0, 8)) == [True] * 8
    damage(path)  # type: ignore[operator]
    with pytest.raises(ArenaDamagedError, match="payload_bytes is needed to replace it"):
        ArenaStore(path, FP)  # a reader that could not make one says what is wrong
    with caplog.at_level(logging.WARNING), _open(path) as store:
        assert "damaged" in caplog.text and "replaced by a fresh, empty arena" in caplog.text
        assert _read(store, _keys(0, 8)) == [False] * 8  # a cache: the entries are gone
        assert _put(store, _keys(8, 16)) == [True] * 8
        assert _read(store, _keys(8, 16)) == [True] * 8
    with ArenaStore(path, FP) as again:  # the replacement is a whole arena
        assert _read(again, _keys(8, 16)) == [True] * 8
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_handles_of_the_damaged_file_follow_its_replacement(path: Path) -> None:
    """A producer keeps its handle while the header is damaged and a restarted consumer replaces
    the file: the producer moves to the new file, and what it saves the consumer reads."""
    with _open(path) as producer:
        assert _put(producer, _keys(0, 4)) == [True] * 4
        _magic(path)
        with _open(path) as consumer:
            producer._next_file_check = 0  # the check runs at most once a second
            assert _put(producer, _keys(4, 8)) == [True] * 4
            assert _read(consumer, _keys(4, 8)) == [True] * 4
            assert _read(producer, _keys(0, 4)) == [False] * 4  # gone with the old file


def _columns(store: ArenaStore) -> dict[str, np.ndarray]:
    return store._map.np


@pytest.mark.parametrize("locked_reads", [False, True], ids=["c-protocol", "locked-reads"])
def test_garbage_metadata_costs_misses_never_a_failed_save(path: Path, locked_reads: bool) -> None:
    with _open(path, slots=64, locked_reads=locked_reads) as store:
        assert _put(store, _keys(0, 40)) == [True] * 40
        rng = np.random.default_rng(0)
        geometry = store.geometry
        metadata = geometry.data_offset - _PAGE  # table and slot columns, after the header
        _overwrite(path, _PAGE, rng.bytes(metadata))
        _overwrite(path, 64, b"\xff" * 64)  # the shared counters (hand, evictions, hits...)
        assert np.count_nonzero(_columns(store)["state"] > COMMITTED) > 0
        store._last_reclaim = 0  # the writers' look runs at most once a second
        for lo in range(100, 300, 20):  # more than the arena holds: every slot is reused
            assert _put(store, _keys(lo, lo + 20)) == [True] * 20
            assert _read(store, _keys(lo, lo + 20)) == [True] * 20  # each hit its own payload
        _read(store, _keys(0, 40))  # misses or right payloads (checked), never an exception
        assert store.stats().entries <= geometry.slot_count
        assert not store._map.damage()
        states = _columns(store)["state"]
        assert set(np.unique(states).tolist()) <= {FREE, WRITING, COMMITTED}


def test_a_new_handle_repairs_garbage_metadata(path: Path) -> None:
    with _open(path, slots=64) as store:
        _put(store, _keys(0, 10))
        geometry = Geometry(store.payload_bytes, store.geometry.slot_count)
    columns = {name: offset for name, _, _, offset in geometry.columns()}
    _overwrite(path, columns["tslot"], b"\xfe\xff\xff\x7f" * 32)  # cells naming no slot
    _overwrite(path, columns["state"], bytes([9]) * 16)  # slots in no known state
    with _open(path, slots=64) as again:
        assert not again._map.damage()
        assert _put(again, _keys(10, 74)) == [True] * 64  # every slot usable again
        assert again.stats().entries == 64


def test_a_writer_with_a_garbage_pid_is_reclaimed(path: Path) -> None:
    with _open(path, slots=8) as store:
        slot = 3
        with store._locked():
            store._slot_protocol.begin_write(slot, 1, 2, pid_namespace() << 32 | 0xFFFFFFFF, 0)
        assert _columns(store)["state"][slot] == WRITING
        assert store.reclaim() == 1  # a pid past the kernel's limit is no live process
        assert _columns(store)["state"][slot] == FREE


def test_an_arena_file_of_another_size_is_replaced_only_when_damaged(path: Path) -> None:
    """A whole arena of another geometry is a configuration error, not damage: refused."""
    _open(path, slots=8).close()
    with pytest.raises(ValueError, match="8 slots, 9 asked"):
        _open(path, slots=9)
    with pytest.raises(ValueError, match=f"{ENTRY} B payloads, 999 B asked"):
        ArenaStore(path, FP, payload_bytes=999)
