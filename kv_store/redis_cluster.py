"""Redis Cluster behind `RedisStore`: `redis+cluster://host:port[,host:port…]` (`rediss+…`: TLS).

redis-py's `RedisCluster` discovers the topology (CLUSTER SLOTS from any listed node) and owns a
connection pool per node; `RedisStore` groups a batch by the node owning each key's slot and
pipelines every group on that node's pool, the groups in parallel (see `redis_store.py`), so the
zero-copy framing (`redis_wire.py`) is the same as on one server: the store never goes through
redis-py's packers.

Keys carry no `{hash tag}`: one request's blocks spread over every shard, and so do its loads.

Failures keep the store's contract. The topology is discovered lazily: an unreachable cluster at
start-up is a miss for every key until a node answers (retried at most every
`_RETRY_CONNECT_S`). A key whose node is down is a miss; a `MOVED` reply (resharding, failover)
refreshes the slot map and retries those keys once; a lost connection refreshes it at most every
`_REFRESH_AFTER_LOSS_S`, so a promoted replica is found without stalling every call on a dead node.
With no replicas, set `cluster-require-full-coverage no` on the servers so the live shards keep
answering while one is down (with `yes` they all reply CLUSTERDOWN: misses, never errors).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException

from kv_store.base import RateLimitedWarning
from kv_store.redis_store import Route, Topology
from kv_store.redis_wire import Failure

logger = logging.getLogger(__name__)

_RETRY_CONNECT_S = 1.0
_CLUSTER_ERRORS = (redis.RedisError, RedisClusterException, OSError)
_REFRESH_AFTER_MOVED_S = 0.1
_REFRESH_AFTER_LOSS_S = 5.0
SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def parse_cluster_url(url: str) -> tuple[str, list[tuple[str, int]]]:
    """`redis+cluster://[user:pw@]h1:p1,h2:p2/?q` → (`redis://[user:pw@]h1:p1/?q`, every node).

    Raises ValueError on a bad URL (no node, a port that is not a number, a db other than 0).
    """
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"not a Redis Cluster URL: {url!r}")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = [_host_port(h, url) for h in hosts.split(",") if h]
    if not nodes:
        raise ValueError(f"no cluster node in {url!r}")
    if parts.path not in ("", "/", "/0"):
        raise ValueError(f"a Redis Cluster has only db 0: {url!r}")
    host, port = nodes[0]
    netloc = (userinfo + "@" if userinfo else "") + (f"[{host}]" if ":" in host else host)
    first = urlunsplit((SCHEMES[parts.scheme], f"{netloc}:{port}", "", parts.query, ""))
    return first, nodes


def _host_port(text: str, url: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or host.endswith(":"):  # no port, or a bare IPv6 address
        host, port = text, "6379"
    if not port.isdigit():
        raise ValueError(f"bad cluster node {text!r} in {url!r}")
    return host.strip("[]"), int(port)


class ClusterTopology(Topology):
    """Slot → primary → connection pool, from redis-py's `RedisCluster` (connected lazily)."""

    def __init__(self, url: str, socket_timeout_s: float, connect_timeout_s: float) -> None:
        self._url, self._nodes = parse_cluster_url(url)
        self._timeouts = (socket_timeout_s, connect_timeout_s)
        self._lock = threading.Lock()
        self._cluster: RedisCluster | None = None
        self._next_connect = 0.0
        self._last_refresh = float("-inf")
        self._closed = False
        self._warn = RateLimitedWarning(logger)
        self._connect()

    # -- Topology -------------------------------------------------------------------------------

    @property
    def width(self) -> int:
        cluster = self._cluster
        return len(cluster.get_primaries()) if cluster is not None else len(self._nodes)

    def routes(self, keys: Sequence[bytes], indices: list[int]) -> list[Route]:
        cluster = self._connect()
        if cluster is None:
            return [Route(None, indices)]
        by_node: dict[str, Route] = {}
        manager = cluster.nodes_manager
        for i in indices:
            try:
                node = manager.get_node_from_slot(key_slot(keys[i]))
                name, pool = node.name, cluster.get_redis_connection(node).connection_pool
            except _CLUSTER_ERRORS:  # slot not covered (a shard lost without replica)
                name, pool = "", None
            by_node.setdefault(name, Route(pool, [])).indices.append(i)
        return list(by_node.values())

    def clients(self) -> list[redis.Redis]:
        cluster = self._connect()
        if cluster is None:
            raise redis.ConnectionError(f"no node of the cluster {self._nodes} answers")
        return [cluster.get_redis_connection(node) for node in cluster.get_primaries()]

    def redirected(self, failures: Sequence[Failure]) -> bool:
        moved = any(f.moved for f in failures)
        self._refresh(_REFRESH_AFTER_MOVED_S if moved else _REFRESH_AFTER_LOSS_S)
        return moved

    def close(self) -> None:
        with self._lock:
            cluster, self._cluster, self._closed = self._cluster, None, True
        if cluster is not None:
            _disconnect(cluster)

    def __repr__(self) -> str:
        return f"ClusterTopology({self._nodes})"

    # -- discovery ------------------------------------------------------------------------------

    def _connect(self) -> RedisCluster | None:
        """The cluster client, connecting first if due; None while no node answers."""
        if self._cluster is not None or self._closed or time.monotonic() < self._next_connect:
            return self._cluster
        with self._lock:
            if self._cluster is None and not self._closed:
                self._next_connect = time.monotonic() + _RETRY_CONNECT_S
                startup = [ClusterNode(host, port) for host, port in self._nodes[1:]]
                try:
                    self._cluster = RedisCluster(
                        url=self._url,
                        startup_nodes=startup,
                        require_full_coverage=False,  # live shards answer while one is down
                        socket_timeout=self._timeouts[0],
                        socket_connect_timeout=self._timeouts[1],
                    )
                except _CLUSTER_ERRORS as exc:
                    self._warn.warn("redis cluster %s unreachable: %s", self._nodes, exc)
            return self._cluster

    def _refresh(self, min_interval_s: float) -> None:
        """Reload the slot map from any live node, unless it was reloaded `min_interval_s` ago."""
        cluster = self._cluster
        now = time.monotonic()
        if cluster is None or now - self._last_refresh < min_interval_s:
            return
        self._last_refresh = now
        try:
            cluster.nodes_manager.initialize()
        except _CLUSTER_ERRORS as exc:
            self._warn.warn("redis cluster topology refresh failed: %s", exc)


def _disconnect(cluster: RedisCluster) -> None:
    """Close every node's pool (`RedisCluster.close` leaves pools it did not create open)."""
    for node in cluster.get_nodes():
        if node.redis_connection is not None:
            node.redis_connection.connection_pool.disconnect()
    cluster.close()
