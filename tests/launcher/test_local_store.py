"""``pdserve up``'s private Redis takes a password no other local user can read (it had none: any
local process could read and overwrite the KV entries), and ``--api-key-file`` keeps the key off
``up``'s own command line."""

from __future__ import annotations

import asyncio
import os
import socket
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from launcher.local_store import shown, start_kv_store
from tests.launcher.test_cluster_config import config


def _ask(port: int, *commands: str) -> list[bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall("".join(f"{c}\r\n" for c in commands).encode())
        reader = sock.makefile("rb")
        return [reader.readline() for _ in commands]


def test_the_private_redis_needs_its_password(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    url, redis = asyncio.run(
        start_kv_store(config("--kv-store", "redis"), tmp_path, tmp_path / "logs", dict(os.environ))
    )
    assert redis is not None
    try:
        parts = urlsplit(url)
        assert parts.password and len(parts.password) >= 32 and parts.port
        assert _ask(parts.port, "PING")[0].startswith(b"-NOAUTH")
        assert _ask(parts.port, f"AUTH {parts.password}", "PING") == [b"+OK\r\n", b"+PONG\r\n"]
        argv = Path(f"/proc/{redis.proc.pid}/cmdline").read_bytes()
        assert parts.password.encode() not in argv  # ps shows no password
        conf = tmp_path / "redis.conf"
        assert conf.stat().st_mode & 0o777 == 0o600
        assert parts.password not in shown(url) and shown(url).startswith("redis://:***@127.0.0.1:")
    finally:
        redis.kill_group()
        redis.proc.wait()


def test_api_key_file(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret-key\n")
    assert config("--api-key-file", str(key)).api_key == "s3cret-key"
    with pytest.raises(ValueError, match="give one"):
        config("--api-key", "a", "--api-key-file", str(key))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="no key on its first line"):
        config("--api-key-file", str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="--api-key-file"):
        config("--api-key-file", str(tmp_path / "missing"))
