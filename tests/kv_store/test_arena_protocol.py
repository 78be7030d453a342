"""The arena's slot protocol: the C atomics (`AtomicSlots`) against the plain Python reference
(`LockedSlots`), writers and readers in several processes where the generation alone must catch
every tear (the checksums never), and the mode of a machine with no C compiler."""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kv_store import HEADER_SIZE, ArenaStore
from kv_store import arena_slots as slots_module
from kv_store.arena_slots import COMMITTED, FREE, SLOT_COLUMNS, WRITING, AtomicSlots, LockedSlots
from kv_store.arena_store import ArenaGeometryError, ArenaProtocolError, arena_path
from tests.kv_store import block_key, payload_for

FP = "tiny-llama|float32|bs16|L4|kv2|d32"
LIB = slots_module.load_library()
needs_c = pytest.mark.skipif(LIB is None, reason=f"no C slot protocol: {slots_module.load_error()}")


def _columns(n: int) -> tuple[dict[str, np.ndarray], dict[str, memoryview]]:
    arrays = {name: np.zeros(n, fmt) for name, fmt in SLOT_COLUMNS}
    return arrays, {name: memoryview(a) for name, a in arrays.items()}


@needs_c
def test_c_protocol_matches_the_python_reference() -> None:
    """Random state changes through both protocols leave identical columns and answers."""
    assert LIB is not None
    n, rng = 64, random.Random(0)
    c_np, _ = _columns(n)
    ref_np, ref_mv = _columns(n)
    c, ref = AtomicSlots(LIB, c_np), LockedSlots(ref_mv, ref_np)
    gens: dict[int, int] = {}
    for step in range(4000):
        slot, d0, d1 = rng.randrange(n), rng.randrange(3), rng.randrange(2)
        op = rng.choice(["write", "commit", "free", "read", "scan"])
        if op == "write":
            gens[slot] = c.begin_write(slot, d0, d1, 7, step)
            assert ref.begin_write(slot, d0, d1, 7, step) == gens[slot] and gens[slot] & 1
        elif op == "commit":
            gen = gens.get(slot, 1)
            assert c.commit(slot, gen, step) == ref.commit(slot, gen, step)
        elif op == "free":
            c.free(slot)
            ref.free(slot)
        elif op == "read":
            gen = c.read_begin(slot, d0, d1)
            assert gen == ref.read_begin(slot, d0, d1)
            assert gen < 0 or c.read_end(slot, gen) == ref.read_end(slot, gen) is True
        else:
            lo = rng.randrange(n)
            hi, want = rng.randrange(lo, n + 1), rng.randrange(1, 5)
            assert c.clock_scan(lo, hi, want) == ref.clock_scan(lo, hi, want)
        for name, _ in SLOT_COLUMNS:
            assert np.array_equal(c_np[name], ref_np[name]), (step, op, name)
    assert set(np.unique(c_np["state"]).tolist()) == {FREE, WRITING, COMMITTED}


@needs_c
def test_generations_seen_by_a_reader() -> None:
    assert LIB is not None
    arrays, _ = _columns(2)
    s = AtomicSlots(LIB, arrays)
    gen = s.begin_write(1, 5, 6, 1, 0)
    assert s.read_begin(1, 5, 6) == -1  # WRITING: odd generation
    assert s.commit(1, gen, 99) and s.read_begin(1, 5, 6) == gen + 1
    assert s.read_begin(1, 5, 7) == -1  # another key
    assert not s.commit(1, gen, 99)  # a claim is committed once
    s.free(1)
    assert not s.read_end(1, gen + 1) and s.read_begin(1, 5, 6) == -1
    assert arrays["ref"][1] == 0


# -- several processes --------------------------------------------------------------------------

ENTRY, NUM_KEYS, SLOTS, DURATION_S, BATCH = 64 << 10, 16, 8, 1.5, 4


def _random_batches(seed: int) -> Iterator[tuple[random.Random, list[str]]]:
    """(rng, a batch of BATCH random keys of NUM_KEYS) for DURATION_S."""
    rng = random.Random(seed)
    keys = [block_key(FP, i) for i in range(NUM_KEYS)]
    deadline = time.monotonic() + DURATION_S
    while time.monotonic() < deadline:
        yield rng, rng.sample(keys, BATCH)


@functools.cache
def _payload(key: str) -> bytes:
    return payload_for(key, ENTRY)


def _writer(path: Path, seed: int) -> int:
    """Put random batches (as two chunks) for DURATION_S; returns the puts that stuck."""
    ok = 0
    with ArenaStore(path, FP, workers=1) as store:
        for rng, batch in _random_batches(seed):
            cut = rng.randrange(1, ENTRY)
            data = [[memoryview(_payload(k))[:cut], memoryview(_payload(k))[cut:]] for k in batch]
            ok += sum(store.put_many(batch, data, [16] * BATCH))
    return ok


def _reader(path: Path, seed: int) -> dict[str, int]:
    """Get random batches (into one buffer or two chunks) for DURATION_S."""
    counts = dict.fromkeys(["hits", "misses", "corrupt"], 0)
    with ArenaStore(path, FP, workers=1) as store:
        for rng, batch in _random_batches(seed):
            bufs = [bytearray(ENTRY) for _ in batch]
            out: list[Any] = [memoryview(b) for b in bufs]
            if rng.random() < 0.5:
                out = [[view[: ENTRY // 3], view[ENTRY // 3 :]] for view in out]
            for key, hit, buf in zip(batch, store.get_many_into(batch, [16] * BATCH, out), bufs):
                counts["hits" if hit else "misses"] += 1
                counts["corrupt"] += hit and buf != _payload(key)
        counts["generation_misses"] = store.generation_misses
        counts["checksum_catches"] = store.checksum_catches
        counts["locked_reads"] = store.locked_reads
    return counts


def _hammer(path: Path) -> dict[str, int]:
    """Two writers and two readers on the arena at `path` (SLOTS slots, NUM_KEYS keys), forked:
    they open their own handles, and start in milliseconds where spawning takes seconds."""
    ctx = mp.get_context("fork")
    with ctx.Pool(4) as pool:
        writes = [pool.apply_async(_writer, (path, seed)) for seed in range(2)]
        reads = [pool.apply_async(_reader, (path, seed)) for seed in range(2)]
        puts = sum(w.get(60) for w in writes)
        totals = {k: sum(r[k] for r in (x.get(60) for x in reads)) for k in _reader_keys()}
    return {"puts": puts, **totals}


def _reader_keys() -> list[str]:
    return ["hits", "misses", "corrupt", "generation_misses", "checksum_catches", "locked_reads"]


def _fresh(path: Path, *, locked_reads: bool) -> None:
    capacity = SLOTS * -(-(HEADER_SIZE + ENTRY) // 64) * 64
    ArenaStore(
        path, FP, payload_bytes=ENTRY, capacity_bytes=capacity, locked_reads=locked_reads
    ).close()


@needs_c
def test_c_protocol_readers_never_need_the_checksum(tmp_path: Path) -> None:
    """Lock-free readers against writers evicting under them: every tear is a generation miss;
    the checksum fallback never fires and no hit holds another version's bytes."""
    path = arena_path(FP, tmp_path)
    _fresh(path, locked_reads=False)
    got = _hammer(path)
    assert got["locked_reads"] == 0
    assert got["corrupt"] == 0 and got["checksum_catches"] == 0, got
    assert got["puts"] > 0 and got["hits"] > 0 and got["misses"] > 0, got


def test_locked_reads_never_need_the_checksum(tmp_path: Path) -> None:
    path = arena_path(FP, tmp_path)
    _fresh(path, locked_reads=True)
    got = _hammer(path)
    assert got["locked_reads"] == 2
    assert got["corrupt"] == 0 and got["checksum_catches"] == 0 and got["generation_misses"] == 0
    assert got["puts"] > 0 and got["hits"] > 0 and got["misses"] > 0, got


# -- no C compiler ------------------------------------------------------------------------------

_NO_COMPILER_CHILD = textwrap.dedent(
    """
    import logging, sys
    sys.modules["torch"] = None  # the store needs no torch, on either path
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from kv_store import ArenaStore
    from kv_store.arena_store import ArenaProtocolError
    from tests.kv_store import block_key, payload_for
    path, fp, keys = sys.argv[1], sys.argv[2], [block_key(sys.argv[2], i) for i in range(3)]
    try:
        store = ArenaStore(path, fp, payload_bytes=1000, capacity_bytes=8 << 10)
    except ArenaProtocolError as exc:
        print("refused:", exc)
        sys.exit(0)
    with store:
        assert store.locked_reads
        assert store.put_many(keys, [payload_for(k, 1000) for k in keys], [16] * 3) == [True] * 3
        assert store.get_many(keys[:2], [16] * 2) == [payload_for(k, 1000) for k in keys[:2]]
        assert store.delete_many(keys[2:]) == 1 and store.contains_many(keys) == [1, 1, 0]
        print("locked reads ok")
    """
)


def _without_a_compiler(path: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": "/nonexistent", "PDSERVE_CACHE_DIR": str(cache)}
    env.pop("CC", None)
    repo = Path(__file__).resolve().parents[2]
    args = [sys.executable, "-c", _NO_COMPILER_CHILD, str(path), FP]
    return subprocess.run(args, env=env, cwd=repo, capture_output=True, text=True, timeout=60)


def test_without_a_compiler_reads_take_the_lock(tmp_path: Path) -> None:
    path = arena_path(FP, tmp_path / "kv")
    done = _without_a_compiler(path, tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "locked reads ok"
    warnings = [line for line in done.stderr.splitlines() if "slot protocol" in line]
    assert len(warnings) == 1 and "take a lock for every read" in warnings[0], done.stderr
    # a process that has the C protocol follows the arena's mode
    with ArenaStore(path, FP) as store:
        assert store.locked_reads
        keys = [block_key(FP, i) for i in range(3)]
        expected = [payload_for(keys[0], 1000), payload_for(keys[1], 1000), None]
        assert store.get_many(keys, [16] * 3) == expected


@needs_c
def test_without_a_compiler_a_lock_free_arena_is_refused(tmp_path: Path) -> None:
    path = arena_path(FP, tmp_path / "kv")
    ArenaStore(path, FP, payload_bytes=1000, capacity_bytes=8 << 10).close()
    done = _without_a_compiler(path, tmp_path / "cache")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("refused: ") and "read lock-free" in done.stdout
    with pytest.raises(ArenaProtocolError, match="locked reads were asked"):
        ArenaStore(path, FP, locked_reads=True)


@needs_c
def test_the_c_protocol_loads_without_torch(tmp_path: Path) -> None:
    child = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None
        from kv_store import ArenaStore
        with ArenaStore(sys.argv[1], "fp", payload_bytes=100, capacity_bytes=1 << 16) as store:
            print("locked" if store.locked_reads else "lock-free")
        """
    )
    args = [sys.executable, "-c", child, str(tmp_path / "a.arena")]
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run(args, cwd=repo, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, "lock-free"), done.stderr


def test_an_arena_of_the_previous_layout_says_so(tmp_path: Path) -> None:
    path = arena_path(FP, tmp_path)
    ArenaStore(path, FP, payload_bytes=1000, capacity_bytes=8 << 10).close()
    with open(path, "r+b") as f:  # version 1 (no slot protocol in its header)
        f.seek(8)
        f.write((1).to_bytes(4, "little"))
    with pytest.raises(ArenaGeometryError, match="layout version 1, this pdserve uses 2"):
        ArenaStore(path, FP)
