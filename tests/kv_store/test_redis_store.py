"""RedisStore against a real, private redis-server (see tests/conftest.py)."""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from kv_store import HEADER_SIZE, RedisStore, redis_store, redis_wire
from tests.conftest import REDIS_SERVER, RedisServer, TLSFiles, free_port, tls_server_args
from tests.kv_store import block_key, payload_for

FP = "tiny-llama|float32|bs16|L4|kv2|d32"
SIZES = [1, 100, 4096, 32768, 65536, 2 << 20]


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RedisStore]:
    with RedisStore(redis_server.url, FP) as s:
        yield s


def _put(store: RedisStore, keys: list[str], size: int, num_tokens: int = 16) -> list[bool]:
    return store.put_many(keys, [payload_for(k, size) for k in keys], [num_tokens] * len(keys))


def _read(store: RedisStore, keys: list[str], size: int, num_tokens: int = 16) -> list[bool]:
    """get_many_into; asserts every hit holds exactly the key's payload."""
    out = [memoryview(bytearray(size)) for _ in keys]
    found = store.get_many_into(keys, [num_tokens] * len(keys), out)
    for key, hit, buf in zip(keys, found, out):
        assert not hit or buf.tobytes() == payload_for(key, size), key
    return found


@pytest.mark.parametrize("size", SIZES)
def test_round_trip(store: RedisStore, size: int) -> None:
    keys = [block_key(FP, i) for i in range(4)]
    assert _put(store, keys, size) == [True] * 4
    assert _read(store, keys, size) == [True] * 4
    assert store.get_many(keys, [16] * 4) == [payload_for(k, size) for k in keys]


def test_numpy_buffers_in_and_out(store: RedisStore) -> None:
    src = np.random.default_rng(0).standard_normal((4, 2, 16, 2, 32)).astype(np.float16)
    dst = np.zeros_like(src)
    assert store.put_many(["k"], [memoryview(src)], [16]) == [True]
    assert store.get_many_into(["k"], [16], [memoryview(dst)]) == [True]
    assert np.array_equal(src, dst)


def test_contains_many(store: RedisStore) -> None:
    keys = [block_key(FP, i) for i in range(10)]
    _put(store, keys[::2], 64)
    assert store.contains_many(keys) == [i % 2 == 0 for i in range(10)]
    assert store.contains_many([]) == []


def test_stats_and_counters(store: RedisStore) -> None:
    keys = [block_key(FP, i) for i in range(5)]
    _put(store, keys[:3], 1000)
    _read(store, keys, 1000)
    stats = store.stats()
    assert (stats.entries, stats.bytes) == (3, 3 * (HEADER_SIZE + 1000))
    assert (stats.puts, stats.gets, stats.hits, stats.misses, stats.errors) == (3, 5, 3, 2, 0)
    assert stats.hit_rate == pytest.approx(0.6)


def test_corrupt_entry_is_a_miss(store: RedisStore, redis_server: RedisServer) -> None:
    keys = [block_key(FP, i) for i in range(3)]
    _put(store, keys, 4096)
    client = redis_server.client()
    client.setrange(keys[0], HEADER_SIZE + 100, b"\xff")  # payload byte
    client.setrange(keys[1], 10, b"\x07")  # header byte
    assert _read(store, keys, 4096) == [False, False, True]
    client.set(keys[2], b"not an entry")
    assert store.get_many(keys, [16] * 3) == [None, None, None]


def test_foreign_fingerprint_token_count_or_size_is_a_miss(
    store: RedisStore, redis_server: RedisServer
) -> None:
    key = block_key(FP, 0)
    _put(store, [key], 512, num_tokens=16)
    with RedisStore(redis_server.url, "other-model") as other:
        assert other.get_many_into([key], [16], [memoryview(bytearray(512))]) == [False]
    assert _read(store, [key], 512, num_tokens=15) == [False]
    assert _read(store, [key], 511) == [False]
    assert _read(store, [key], 512) == [True]


def test_killed_server_is_misses_then_recovers(
    store: RedisStore, redis_server: RedisServer
) -> None:
    keys = [block_key(FP, i) for i in range(4)]
    _put(store, keys, 256)
    redis_server.kill()
    assert _read(store, keys, 256) == [False] * 4
    assert store.get_many(keys, [16] * 4) == [None] * 4
    assert store.contains_many(keys) == [False] * 4
    assert _put(store, keys, 256) == [False] * 4
    assert store.delete_many(keys) == 0
    assert store._counters.errors == 4 * 5  # stats() needs the server; its counters do not

    redis_server.restart()  # back, but empty
    assert _read(store, keys, 256) == [False] * 4
    assert _put(store, keys, 256) == [True] * 4
    assert _read(store, keys, 256) == [True] * 4


def test_ttl_from_url_and_kwarg(redis_server: RedisServer) -> None:
    client = redis_server.client()
    with RedisStore(redis_server.url + "?ttl=100", FP) as s:
        _put(s, ["a"], 10)
        assert 0 < client.ttl("a") <= 100
    with RedisStore(redis_server.url + "?ttl=100", FP, ttl_s=5) as s:
        _put(s, ["b"], 10)
        assert 0 < client.ttl("b") <= 5
    with RedisStore(redis_server.url, FP) as s:
        _put(s, ["c"], 10)
        assert client.ttl("c") == -1


def test_password_and_db_in_url(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(password="s3cret")
    base = f"127.0.0.1:{server.port}"
    for url in (f"redis://:s3cret@{base}/3", f"redis://default:s3cret@{base}/3"):
        with RedisStore(url, FP) as s:
            assert _put(s, ["k"], 10) == [True] and _read(s, ["k"], 10) == [True]
    with RedisStore(f"redis://:wrong@{base}/3", FP) as s:
        assert _put(s, ["k"], 10) == [False] and _read(s, ["k"], 10) == [False]


def test_allkeys_lru_evicts_but_never_corrupts(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory(maxmemory="4mb", policy="allkeys-lru")
    keys = [block_key(FP, i) for i in range(200)]  # 200 x 64 KiB = 12.5 MiB > 4 MiB
    with RedisStore(server.url, FP) as s:
        for i in range(0, 200, 10):
            _put(s, keys[i : i + 10], 65536)
        found = _read(s, keys, 65536)  # _read checks every hit byte for byte
        assert 0 < sum(found) < 200
        # Redis's LRU is approximate (it samples keys), so compare old vs recent, not exact keys.
        assert sum(found[:50]) < sum(found[-50:])
        assert s.stats().evictions > 0


def test_oom_write_returns_false(redis_server_factory: Callable[..., RedisServer]) -> None:
    server = redis_server_factory(maxmemory="2mb", policy="noeviction")
    keys = [block_key(FP, i) for i in range(64)]
    with RedisStore(server.url, FP) as s:
        ok = [r for i in range(0, 64, 8) for r in _put(s, keys[i : i + 8], 65536)]
        assert ok[0] and not ok[-1]
        assert s.stats().errors == ok.count(False)
        assert _read(s, keys, 65536) == ok


def test_namespaces_are_isolated(redis_server: RedisServer) -> None:
    fp_glob = "weird*fp[x]?"  # glob metacharacters must not widen SCAN MATCH
    with RedisStore(redis_server.url, FP) as a, RedisStore(redis_server.url, fp_glob) as b:
        _put(a, [block_key(FP, i) for i in range(3)], 10)
        _put(b, [block_key(fp_glob, i) for i in range(2)], 10)
        _put(a, ["weird-fp-unrelated"], 10)
        assert (a.stats().entries, b.stats().entries) == (3, 2)
        assert b.clear() == 2
        assert (a.stats().entries, b.stats().entries) == (3, 0)
        assert a.delete_many([block_key(FP, 0), "missing"]) == 1
        assert a.clear() == 2
        assert redis_server.client().exists("weird-fp-unrelated") == 1


def test_one_writer_one_reader_thread(store: RedisStore) -> None:
    keys = [block_key(FP, i) for i in range(64)]
    errors: list[BaseException] = []

    def writer() -> None:
        for _ in range(5):
            for i in range(0, 64, 8):
                _put(store, keys[i : i + 8], 8192)

    def reader() -> None:
        try:
            for _ in range(40):
                _read(store, keys, 8192)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _read(store, keys, 8192) == [True] * 64


# -- chunked payloads (one entry = several buffers, e.g. per-layer slices) ---------------------


def _chunks(buf: bytes | bytearray, sizes: list[int]) -> list[memoryview]:
    offsets = np.cumsum([0, *sizes]).tolist()
    return [memoryview(buf)[a:b] for a, b in itertools.pairwise(offsets)]


def test_chunked_payloads_round_trip_in_any_split(store: RedisStore) -> None:
    keys = [block_key(FP, i) for i in range(6)]
    size = 4 * 8192
    payloads = [payload_for(k, size) for k in keys]
    assert store.put_many(keys, [_chunks(p, [8192] * 4) for p in payloads], [16] * 6) == [True] * 6
    outs = [bytearray(size) for _ in keys]
    splits = [
        [size],
        [1, size - 1],
        [8192] * 4,
        [100, 0, size - 100],
        [size // 3, size - size // 3],
    ]
    splits.append([64] * (size // 64))  # 512 tiny destination chunks
    assert (
        store.get_many_into(keys, [16] * 6, [_chunks(o, s) for o, s in zip(outs, splits)])
        == [True] * 6
    )
    assert [bytes(o) for o in outs] == payloads
    assert store.get_many(keys, [16] * 6) == payloads  # chunks are one payload, in order
    # the same entry written as one buffer has the same header: chunking never shows
    store.put_many(keys[:1], [payloads[0]], [16])
    assert store.get_many_into(keys[:1], [16], [_chunks(outs[0], [10, size - 10])]) == [True]


def test_chunked_destination_of_the_wrong_total_size_is_a_miss(store: RedisStore) -> None:
    key = block_key(FP, 0)
    store.put_many([key], [[b"a" * 100, b"b" * 100]], [16])
    short, long_ = bytearray(199), bytearray(201)
    assert store.get_many_into([key] * 2, [16] * 2, [_chunks(short, [99, 100]), [long_]]) == [
        False,
        False,
    ]
    with pytest.raises(ValueError):  # read-only destination: a programming error
        store.get_many_into([key], [16], [[memoryview(b"x" * 200)]])


# -- several connections per batch -------------------------------------------------------------


@pytest.fixture
def small_slices(monkeypatch: pytest.MonkeyPatch) -> int:
    """Slices of 64 KiB, so that test-sized batches take the parallel path."""
    monkeypatch.setattr(redis_store, "MIN_SLICE_BYTES", 65536)
    return 65536


def test_connections_from_url_and_default(redis_server: RedisServer) -> None:
    with RedisStore(redis_server.url + "?connections=3&ttl=9", FP) as s:
        assert (s.connections, s.ttl_s) == (3, 9)
    with RedisStore(redis_server.url, FP) as s:
        assert s.connections == redis_store.default_connections() >= 1
    with pytest.raises(ValueError):
        RedisStore(redis_server.url + "?protocol=3", FP)


def test_small_batches_stay_one_slice(redis_server: RedisServer) -> None:
    keys = [block_key(FP, i) for i in range(64)]
    with RedisStore(redis_server.url, FP, connections=4) as s:  # 64 x 32 KiB < MIN_SLICE_BYTES
        _put(s, keys, 32768)
        assert _read(s, keys, 32768) == [True] * 64
        assert s._executor is None
        with redis_server.client() as client:
            assert len(client.client_list()) == 2  # the store's one connection + this one


def test_parallel_slices_use_several_connections(
    redis_server: RedisServer, small_slices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of 16 x 64 KiB with 4 connections runs as 4 slices at once: each slice waits at a
    barrier until all four are on the wire, so they must hold 4 connections together."""
    keys = [block_key(FP, i) for i in range(16)]
    barrier = threading.Barrier(4, timeout=10)
    real_send = redis_wire._send

    def send_together(sock, pieces):
        barrier.wait()
        real_send(sock, pieces)

    with RedisStore(redis_server.url, FP, connections=4) as s:
        monkeypatch.setattr(redis_wire, "_send", send_together)
        assert _put(s, keys, 65536) == [True] * 16
        assert _read(s, keys, 65536) == [True] * 16
        with redis_server.client() as client:
            assert len(client.client_list()) == 4 + 1
        monkeypatch.setattr(redis_wire, "_send", real_send)
        missing = {1, 6, 7, 15}  # results stay in key order across slices
        assert s.delete_many([keys[i] for i in missing]) == 4
        assert _read(s, keys, 65536) == [i not in missing for i in range(16)]
        assert s.contains_many(keys) == [i not in missing for i in range(16)]
        got = s.get_many(keys, [16] * 16)
        assert got == [None if i in missing else payload_for(k, 65536) for i, k in enumerate(keys)]


def test_parallel_slices_from_several_threads(redis_server: RedisServer, small_slices: int) -> None:
    """Writer, reader and scheduler threads share one store and its thread pool."""
    keys = [block_key(FP, i) for i in range(48)]
    errors: list[BaseException] = []
    with RedisStore(redis_server.url, FP, connections=3) as s:
        _put(s, keys, 40000)

        def work(fn: Callable[[], object]) -> None:
            try:
                for _ in range(15):
                    fn()
            except BaseException as exc:
                errors.append(exc)

        jobs = [
            lambda: _put(s, keys[::2], 40000),
            lambda: _read(s, keys, 40000),
            lambda: s.contains_many(keys) == [True] * 48 or errors.append(AssertionError()),
        ]
        threads = [threading.Thread(target=work, args=(job,)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        assert _read(s, keys, 40000) == [True] * 48


def test_server_killed_during_a_parallel_batch(
    redis_server: RedisServer, small_slices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = [block_key(FP, i) for i in range(16)]
    with RedisStore(redis_server.url, FP, connections=4) as s:
        _put(s, keys, 65536)
        real_send = redis_wire._send

        def kill_then_send(sock, pieces):
            redis_server.kill()
            real_send(sock, pieces)

        monkeypatch.setattr(redis_wire, "_send", kill_then_send)
        assert _read(s, keys, 65536) == [False] * 16
        assert _put(s, keys, 65536) == [False] * 16
        assert s._counters.errors == 32


def test_close_stops_the_thread_pool(redis_server: RedisServer, small_slices: int) -> None:
    keys = [block_key(FP, i) for i in range(8)]
    s = RedisStore(redis_server.url, FP, connections=2)
    _put(s, keys, 65536)
    pool = s._executor
    assert pool is not None
    s.close()
    s.close()
    assert s._executor is None and pool._shutdown


# -- TLS -------------------------------------------------------------------------------------


def test_rediss(tls_files: TLSFiles, tmp_path: Path) -> None:
    port = free_port()
    cmd = [REDIS_SERVER, *tls_server_args(tls_files, port), "--bind", "127.0.0.1", "--save", ""]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.DEVNULL)
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={tls_files.ca}"
    try:
        _wait_for_tls(port, tls_files)
        with RedisStore(url, FP, connections=2) as s:
            keys = [block_key(FP, i) for i in range(8)]
            payloads = [payload_for(k, 3 << 20) for k in keys]  # 24 MiB: parallel slices
            assert (
                s.put_many(keys, [_chunks(p, [1 << 20] * 3) for p in payloads], [16] * 8)
                == [True] * 8
            )
            assert _read(s, keys, 3 << 20) == [True] * 8
            assert s.stats().entries == 8
        with RedisStore(url.split("?")[0], FP) as unverified:  # no CA: handshake refused
            assert unverified.contains_many(keys) == [False] * 8
    finally:
        proc.kill()
        proc.wait()


def _wait_for_tls(port: int, tls: TLSFiles) -> None:
    deadline = time.monotonic() + 10
    client = redis.Redis(port=port, ssl=True, ssl_ca_certs=str(tls.ca))
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class _SocketElsewhere(redis.Connection):
    """A redis-py that keeps its socket under another name (as a release may): the raw wire
    finds none where it reads it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        del self._sock


def test_a_redis_py_without_the_socket_is_refused_at_open(redis_server: RedisServer) -> None:
    """Every load would silently be a miss (every prompt recomputed): refused in one line."""
    pool = redis.ConnectionPool(
        host="127.0.0.1", port=redis_server.port, connection_class=_SocketElsewhere
    )
    with pytest.raises(redis_wire.RawWireUnsupported, match=r"Connection\._sock"):
        redis_wire.check_raw_wire(pool)


def test_the_raw_wire_is_checked_with_one_round_trip(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The class looks right but its connected socket is not where it was: the probe's
    exchange finds no socket, and the store refuses to open."""
    real_connect = redis.Connection.connect

    def connect_and_hide(self) -> None:
        real_connect(self)
        self._hidden, self._sock = self._sock, None

    monkeypatch.setattr(redis.Connection, "connect", connect_and_hide)
    with pytest.raises(redis_wire.RawWireUnsupported, match="redis-py"):
        RedisStore(redis_server.url, FP)
