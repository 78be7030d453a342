"""RedisStore on a real 3-node Redis Cluster (`redis+cluster://`, see tests/conftest.py)."""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.cluster import RedisCluster

from kv_store import HEADER_SIZE, RedisStore, cli, open_store, redis_wire
from kv_store.redis_cluster import parse_cluster_url
from kv_store.url import list_fingerprints
from tests.conftest import RedisClusterNodes, TLSFiles, free_port
from tests.kv_store import block_key, payload_for

FP = "tiny-llama|float32|bs16|L4|kv2|d32"


@pytest.fixture
def store(redis_cluster: RedisClusterNodes) -> Iterator[RedisStore]:
    with RedisStore(redis_cluster.url, FP) as s:
        yield s
        s.clear()


def router(nodes: RedisClusterNodes) -> RedisCluster:
    """A redis-py cluster client, to inspect or damage entries wherever they live."""
    return RedisCluster(host="127.0.0.1", port=nodes.ports[0])


def chunked(payload: bytes, pieces: int = 4) -> list[memoryview]:
    step = -(-len(payload) // pieces)
    return [memoryview(payload)[i : i + step] for i in range(0, len(payload), step)]


def _put(store: RedisStore, keys: list[str], size: int, chunks: bool = False) -> list[bool]:
    payloads = [payload_for(k, size) for k in keys]
    return store.put_many(keys, [chunked(p) if chunks else p for p in payloads], [16] * len(keys))


def _read(store: RedisStore, keys: list[str], size: int, num_tokens: int = 16) -> list[bool]:
    """get_many_into, each destination as 3 chunks; asserts every hit is exactly right."""
    outs = [bytearray(size) for _ in keys]
    dsts = [chunked(out, 3) for out in outs]  # type: ignore[arg-type]
    found = store.get_many_into(keys, [num_tokens] * len(keys), dsts)
    for key, hit, out in zip(keys, found, outs):
        assert not hit or bytes(out) == payload_for(key, size), key
    return found


@pytest.mark.parametrize("chunks", [False, True])
@pytest.mark.parametrize("size", [1, 4096, 1 << 20])
def test_round_trip(store: RedisStore, size: int, chunks: bool) -> None:
    keys = [block_key(FP, i) for i in range(24)]
    assert _put(store, keys, size, chunks) == [True] * 24
    assert _read(store, keys, size) == [True] * 24
    assert store.get_many(keys, [16] * 24) == [payload_for(k, size) for k in keys]


def test_one_request_spreads_over_every_shard(
    store: RedisStore, redis_cluster: RedisClusterNodes
) -> None:
    keys = [block_key(FP, i) for i in range(64)]  # the 64 blocks of one 1024-token prompt
    assert all("{" not in k for k in keys)  # no hash tag: slots follow the whole key
    assert _put(store, keys, 256) == [True] * 64
    per_node = []
    for port in redis_cluster.ports:
        with redis_cluster.client(port) as client:
            per_node.append(sum(1 for _ in client.scan_iter(match="pdkv:*", count=1000)))
    assert sum(per_node) == 64 and min(per_node) > 0 and max(per_node) <= 0.6 * 64, per_node


def test_corrupt_or_foreign_entries_are_misses(
    store: RedisStore, redis_cluster: RedisClusterNodes
) -> None:
    keys = [block_key(FP, i) for i in range(4)]
    _put(store, keys, 4096)
    with router(redis_cluster) as client:
        client.setrange(keys[0], HEADER_SIZE + 100, b"\xff")  # payload byte
        client.setrange(keys[1], 10, b"\x07")  # header byte
        client.set(keys[2], b"not an entry")
    assert _read(store, keys, 4096) == [False, False, False, True]
    with RedisStore(redis_cluster.url, "other-model") as other:
        assert other.get_many([keys[3]], [16]) == [None]
    assert _read(store, [keys[3]], 4096, num_tokens=15) == [False]
    assert store.stats().errors == 0  # damaged entries are misses, not backend errors


def test_contains_delete_stats_clear(store: RedisStore, redis_cluster: RedisClusterNodes) -> None:
    keys = [block_key(FP, i) for i in range(30)]
    _put(store, keys[::2], 1000)
    assert store.contains_many(keys) == [i % 2 == 0 for i in range(30)]
    assert store.delete_many(keys[:4]) == 2
    stats = store.stats()
    assert (stats.entries, stats.bytes) == (13, 13 * (HEADER_SIZE + 1000))
    with router(redis_cluster) as client:
        client.set("unrelated", b"x")
        assert store.clear() == 13
        assert store.contains_many(keys) == [False] * 30
        assert client.get("unrelated") == b"x"
        client.delete("unrelated")


def test_open_store_list_fingerprints_and_cli(
    redis_cluster: RedisClusterNodes, capsys: pytest.CaptureFixture[str]
) -> None:
    with open_store(redis_cluster.url + "?ttl=60&connections=3", "fp-a") as a:
        assert isinstance(a, RedisStore) and (a.ttl_s, a.connections) == (60, 3)
        _put(a, [block_key("fp-a", i) for i in range(5)], 100)
    with open_store(redis_cluster.url, "fp-b") as b:
        _put(b, [block_key("fp-b", i) for i in range(3)], 100)
    assert list_fingerprints(redis_cluster.url) == ["fp-a", "fp-b"]
    args = argparse.Namespace(url=redis_cluster.url, fingerprint=None, json=False)
    assert cli.run(argparse.Namespace(**vars(args), action="stats")) == 0
    assert "fp-a: entries=5" in capsys.readouterr().out
    assert cli.run(argparse.Namespace(**vars(args), action="clear")) == 0
    assert "fp-b: deleted 3 entries" in capsys.readouterr().out
    assert list_fingerprints(redis_cluster.url) == []


def test_cluster_urls() -> None:
    first, nodes = parse_cluster_url("rediss+cluster://u:pw@h1:7000,[::1]:7001,h3/?ssl_ca_certs=c")
    assert first == "rediss://u:pw@h1:7000?ssl_ca_certs=c"
    assert nodes == [("h1", 7000), ("::1", 7001), ("h3", 6379)]
    for bad in ("redis+cluster://", "redis+cluster://h:x", "redis+cluster://h:1/2"):
        with pytest.raises(ValueError):
            parse_cluster_url(bad)


def test_unreachable_cluster_is_misses_not_errors() -> None:
    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with RedisStore(url, FP) as s:  # nothing listens: opening still works
        keys = [block_key(FP, i) for i in range(3)]
        assert _put(s, keys, 10) == [False] * 3
        assert _read(s, keys, 10) == [False] * 3
        assert s.contains_many(keys) == [False] * 3 and s.delete_many(keys) == 0
        assert s._counters.errors == 4 * 3
        for maintenance in (s.stats, s.clear):  # operator tools report the outage
            with pytest.raises(redis.RedisError):
                maintenance()


def test_killed_node_is_misses_then_no_exceptions(
    redis_cluster_factory: Callable[..., RedisClusterNodes], monkeypatch: pytest.MonkeyPatch
) -> None:
    nodes = redis_cluster_factory()
    keys = [block_key(FP, i) for i in range(48)]
    with RedisStore(nodes.url, FP) as s, router(nodes) as client:
        assert _put(s, keys, 2048) == [True] * 48
        node_of = [nodes.ports.index(client.get_node_from_key(k).port) for k in keys]
        nodes.kill(1)
        want = [node != 1 for node in node_of]
        assert _read(s, keys, 2048) == want
        assert s.contains_many(keys) == want
        assert _put(s, keys, 2048) == want
        assert s.delete_many(keys[:6]) == sum(want[:6])

        real_send = redis_wire._send

        def kill_mid_batch(sock, pieces):  # node 2 dies with its slice on the wire
            if sock.getpeername()[1] == nodes.ports[2]:
                nodes.kill(2)
            real_send(sock, pieces)

        monkeypatch.setattr(redis_wire, "_send", kill_mid_batch)
        assert _read(s, keys[6:], 2048) == [node == 0 for node in node_of[6:]]  # no exception


def test_moved_keys_are_retried_after_a_topology_refresh(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale slot map (as after a resharding or failover) sends keys to the wrong node: the
    MOVED replies refresh the map and those keys are retried once."""
    cluster = store._topology._connect()  # type: ignore[attr-defined]
    manager, primaries = cluster.nodes_manager, cluster.get_primaries()
    real_lookup, real_initialize = manager.get_node_from_slot, manager.initialize
    stale = [True]

    def wrong_node(slot: int, *args: object, **kwargs: object):
        node = real_lookup(slot, *args, **kwargs)
        return next(n for n in primaries if n.name != node.name) if stale[0] else node

    def refresh(*args: object, **kwargs: object) -> None:
        stale[0] = False
        real_initialize(*args, **kwargs)

    monkeypatch.setattr(manager, "get_node_from_slot", wrong_node)
    monkeypatch.setattr(manager, "initialize", refresh)
    keys = [block_key(FP, i) for i in range(20)]
    assert _put(store, keys, 500) == [True] * 20
    assert not stale[0]
    assert _read(store, keys, 500) == [True] * 20
    assert store.stats().errors == 0


def test_disaggregated_llm_over_the_cluster(
    redis_cluster: RedisClusterNodes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Producer LLM saves into the cluster; a consumer LLM loads every full prompt block and
    continues with exactly the tokens of a plain LLM."""
    os.environ.setdefault("PDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("pdserve-cache")))
    from common import LLM, SamplingParams

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1000) for _ in range(n)] for n in (40, 70)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    args = dict(model="tiny-llama", block_size=16, max_num_batched_tokens=256, num_blocks=256)

    def tokens(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    want = tokens(LLM(**args))
    producer = LLM(kv_store=redis_cluster.url, kv_role="producer", **args)
    assert tokens(producer) == want
    producer.engine.close()
    consumer = LLM(kv_store=redis_cluster.url, kv_role="consumer", **args)
    assert tokens(consumer) == want
    assert consumer.engine.runner.connector.num_loaded_blocks == 2 + 4  # full blocks only
    consumer.check_integrity()
    consumer.engine.close()
    with router(redis_cluster) as client:
        for key in client.scan_iter(match="pdkv:*", target_nodes=RedisCluster.PRIMARIES):
            client.delete(key)


# -- TLS -------------------------------------------------------------------------------------


def test_rediss_cluster(
    tls_files: TLSFiles, redis_cluster_factory: Callable[..., RedisClusterNodes]
) -> None:
    nodes = redis_cluster_factory(tls=tls_files)
    assert nodes.url.startswith("rediss+cluster://")
    with RedisStore(nodes.url, FP) as s:
        _tls_round_trip(s)
    with RedisStore(nodes.url.split("?")[0], FP) as unverified:  # no CA: the handshake fails
        assert unverified.contains_many([block_key(FP, 0)]) == [False]


def _tls_round_trip(s: RedisStore) -> None:
    """Chunked puts, scatter reads (large enough for several TLS records), stats and clear."""
    keys = [block_key(FP, i) for i in range(16)]
    assert _put(s, keys, 300_000, chunks=True) == [True] * 16
    assert _read(s, keys, 300_000) == [True] * 16
    assert s.stats().entries == 16
    assert s.clear() == 16
