"""The KV store of ``pdserve up``: what ``--kv-store`` names, made ready before any node starts.

- ``shm`` (default) / ``file``: a ``kv`` directory in the cluster's directory (RAM-backed under
  /dev/shm), of ``--kv-store-capacity`` bytes at most a quarter of that filesystem: the shm arena
  is allocated up front. The nodes create the store in it when they start.
- ``redis``: a private ``redis-server`` on a free port of 127.0.0.1, persistence off,
  ``--maxmemory`` (``--redis-maxmemory``) with ``allkeys-lru``, and a random password (in a
  0600 config file, never on a command line: any local user could otherwise read and write the
  KV entries). The URL carrying it reaches the nodes through their environment only.
- a store URL: used as it is (and left alone at exit).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from launcher.cluster_config import ClusterConfig
from launcher.ports import HeldPort, PortSpec
from launcher.processes import ManagedProcess, StartupError


async def start_kv_store(
    config: ClusterConfig, workdir: Path, log_dir: Path, env: Mapping[str, str]
) -> tuple[str, ManagedProcess | None]:
    """The store URL the nodes get, and the private redis-server if one was started (the
    caller stops it). StartupError if redis-server does not come up (it is killed then)."""
    spec = config.kv_store
    if spec in ("shm", "file"):
        (workdir / "kv").mkdir()
        capacity = store_bytes(workdir, config.store_capacity())
        return f"{spec}://{workdir / 'kv'}?capacity={capacity}", None
    if spec != "redis":
        return spec, None
    held = HeldPort("127.0.0.1", PortSpec("private Redis", "--kv-store", 0))
    password = secrets.token_hex(16)
    try:
        redis = await _start_redis(config, workdir, log_dir, env, held.port, password)
    finally:
        held.release()
    return f"redis://:{password}@127.0.0.1:{held.port}/0", redis


async def restart_redis(
    config: ClusterConfig, workdir: Path, log_dir: Path, env: Mapping[str, str], url: str
) -> ManagedProcess:
    """The private redis-server of ``url`` again, on its port and password, empty
    (StartupError)."""
    parts = urlsplit(url)
    assert parts.port is not None and parts.password is not None
    return await _start_redis(config, workdir, log_dir, env, parts.port, parts.password)


async def _start_redis(
    config: ClusterConfig,
    workdir: Path,
    log_dir: Path,
    env: Mapping[str, str],
    port: int,
    password: str,
) -> ManagedProcess:
    conf = workdir / "redis.conf"
    conf.touch(mode=0o600)
    conf.write_text(f"requirepass {password}\n")
    argv = [shutil.which("redis-server") or "redis-server", str(conf), "--port", str(port),
            "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--maxmemory", config.redis_maxmemory,
            "--maxmemory-policy", "allkeys-lru", "--dir", str(workdir)]  # fmt: skip
    redis = ManagedProcess("redis", argv, log_dir / "redis.log", env)
    try:
        await _wait_redis(redis, port, password, config.startup_timeout_s)
    except BaseException:
        redis.kill_group()
        redis.proc.wait()
        raise
    return redis


def shown(url: str) -> str:
    """``url`` as printed and logged: its password, if any, starred out."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f":***@{host}").geturl()


def store_bytes(directory: Path, asked: str) -> int:
    """Bytes for a local store: as asked, but at most a quarter of the filesystem it lives on
    (the shm arena allocates all of it up front)."""
    from kv_store.url import parse_size  # light: no torch

    st = os.statvfs(directory)
    return min(parse_size(asked), st.f_frsize * st.f_blocks // 4)


async def _wait_redis(process: ManagedProcess, port: int, password: str, timeout_s: float) -> None:
    """Until the private redis-server takes its password and answers PING (StartupError if it
    exits first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not process.alive:
            raise StartupError(f"redis-server exited:\n{process.log_tail()}")
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"AUTH {password}\r\nPING\r\n".encode())
            replies = [await reader.readline(), await reader.readline()]
            writer.close()
            if replies == [b"+OK\r\n", b"+PONG\r\n"]:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise StartupError("redis-server did not answer PING")
        await asyncio.sleep(0.05)
