"""The file store's SQLite index survives ordinary use: two stores of one directory in one
process (an engine core's two connector halves), ``pdserve kv-store stats`` from another
process while they serve, and a damaged database, which is rebuilt from the entry files."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from kv_store import FileStore
from kv_store.file_store import default_root
from tests.kv_store import block_key, payload_for
from tests.launcher.cluster_harness import REPO

FP = "index-safety"
SIZE = 4096


def _put(store: FileStore, keys: list[str]) -> None:
    assert store.put_many(keys, [payload_for(k, SIZE) for k in keys], [16] * len(keys)) == [
        True
    ] * len(keys)


def _integrity(root: Path) -> str:
    db = sqlite3.connect(f"file:{root / 'index.sqlite3'}?mode=ro", uri=True)
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()


def test_stores_of_one_directory_share_one_index_handle(tmp_path: Path) -> None:
    a = FileStore(tmp_path / "kv", FP, capacity_bytes=1 << 20)
    b = FileStore(tmp_path / "kv", FP, capacity_bytes=1 << 20)
    assert a._index is b._index
    a.close()  # the other store keeps its handle open
    _put(b, [block_key(FP, 1)])
    assert b.contains_many([block_key(FP, 1)]) == [True]
    b.close()
    c = FileStore(tmp_path / "kv", FP, capacity_bytes=1 << 20)  # a fresh handle after the last
    assert c.contains_many([block_key(FP, 1)]) == [True]
    c.close()


def test_stats_from_another_process_leaves_the_index_intact(tmp_path: Path) -> None:
    """The old failure: a second store opened (and closed) the database file, which dropped
    the process's SQLite locks; `stats` in another process then checkpointed the WAL and
    removed it under the serving process: "database disk image is malformed"."""
    root = default_root(FP, tmp_path / "base")  # where `file://…/base` keeps FP's entries
    a = FileStore(root, FP, capacity_bytes=1 << 20)
    _put(a, [block_key(FP, i) for i in range(8)])
    b = FileStore(root, FP, capacity_bytes=1 << 20)  # the connector's other half
    assert (root / "index.sqlite3-wal").exists()
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-m", "pdserve_cli", "kv-store", "stats", "--url",
             f"file://{tmp_path}/base"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0 and "entries" in done.stdout, done
        assert (root / "index.sqlite3-wal").exists(), "stats removed the WAL of a live index"
    _put(b, [block_key(FP, i) for i in range(8, 16)])
    _put(a, [block_key(FP, i) for i in range(16, 24)])
    assert a.contains_many([block_key(FP, i) for i in range(24)]) == [True] * 24
    a.close()
    b.close()
    assert _integrity(root) == "ok"


def test_a_damaged_index_is_rebuilt_from_the_files(tmp_path: Path, caplog) -> None:
    root = tmp_path / "kv"
    store = FileStore(root, FP, capacity_bytes=1 << 20)
    keys = [block_key(FP, i) for i in range(6)]
    _put(store, keys)
    store.close()
    for suffix in ("-wal", "-shm"):
        (root / f"index.sqlite3{suffix}").unlink(missing_ok=True)
    with (root / "index.sqlite3").open("r+b") as f:
        f.write(b"\0" * 100)  # the header gone
    with caplog.at_level(logging.ERROR, logger="kv_store.file_index"):
        store = FileStore(root, FP, capacity_bytes=1 << 20)
    assert "is damaged" in caplog.text
    assert list(root.glob("index.sqlite3.damaged-*"))
    assert store.contains_many(keys) == [True] * 6  # every file adopted, none lost
    assert store.stats().entries == 6
    store.close()
    assert _integrity(root) == "ok"


def test_the_index_never_opens_an_existing_database_file_outside_sqlite(tmp_path, monkeypatch):
    """Opening and closing the database file would drop this process's SQLite locks."""
    root = tmp_path / "kv"
    FileStore(root, FP, capacity_bytes=1 << 20).close()
    opened: list[str] = []
    real_open = os.open

    def spy(path, flags, *args):
        fd = real_open(path, flags, *args)  # an O_EXCL attempt on an existing file opens none
        opened.append(str(path))
        return fd

    monkeypatch.setattr("kv_store.file_index.os.open", spy)
    FileStore(root, FP, capacity_bytes=1 << 20).close()
    assert not [p for p in opened if p.endswith("index.sqlite3")]
