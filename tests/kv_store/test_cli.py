"""`pdserve kv-store stats|clear` through `register()` on a bare argparse parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kv_store import cli, open_store
from tests.conftest import RedisServer
from tests.kv_store import block_key, payload_for

FPS = ("model-a|bf16|bs16", "model-b|fp32|bs16")


def _main(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["kv-store", *argv])
    return int(args.func(args))


def _fill(url: str, counts: tuple[int, int]) -> None:
    for fp, n in zip(FPS, counts):
        keys = [block_key(fp, i) for i in range(n)]
        with open_store(url, fp, payload_bytes=100) as store:  # only the arena needs the size
            assert all(store.put_many(keys, [payload_for(k, 100) for k in keys], [16] * n))
            store.get_many([keys[0], "missing"], [16, 16])  # one hit, one miss


def _json_stats(capsys: pytest.CaptureFixture[str], url: str, *extra: str) -> dict[str, dict]:
    capsys.readouterr()
    assert _main("stats", "--url", url, "--json", *extra) == 0
    lines = capsys.readouterr().out.splitlines()
    return {row["fingerprint"]: row for row in map(json.loads, lines)}


@pytest.fixture(params=["file", "shm", "redis"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/kv"
    if request.param == "shm":
        return f"shm://{tmp_path}/kv?capacity=64KiB"  # the CLI opens it with the same URL
    server: RedisServer = request.getfixturevalue("redis_server")
    return server.url


def test_stats_and_clear(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fill(url, (3, 2))
    stats = _json_stats(capsys, url)
    assert {fp: row["entries"] for fp, row in stats.items()} == {FPS[0]: 3, FPS[1]: 2}
    assert stats[FPS[0]]["bytes"] == 3 * (64 + 100)
    assert stats[FPS[0]]["shared_hit_rate"] is not None

    assert _main("stats", "--url", url, "--fingerprint", FPS[1]) == 0
    line = capsys.readouterr().out
    assert f"{FPS[1]}: entries=2 bytes=328" in line and "hit_rate=" in line

    assert _main("clear", "--url", url, "--fingerprint", FPS[0]) == 0
    assert "deleted 3 entries" in capsys.readouterr().out
    stats = _json_stats(capsys, url, "--fingerprint", FPS[0])
    assert stats[FPS[0]]["entries"] == 0
    assert _main("clear", "--url", url) == 0  # every namespace
    assert all(row["entries"] == 0 for row in _json_stats(capsys, url).values())


@pytest.mark.parametrize("scheme", ["file", "shm"])
def test_local_hit_rate_is_shared_across_handles(tmp_path: Path, scheme: str) -> None:
    url = f"{scheme}://{tmp_path}/kv?capacity=64KiB"
    _fill(url, (2, 1))
    with open_store(url, FPS[0]) as store:  # a fresh handle, e.g. the CLI's
        assert store.stats().shared_hit_rate == pytest.approx(0.5)


def test_unreachable_or_bad_url_is_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert _main("stats", "--url", "redis://127.0.0.1:1/0") == 1
    assert _main("stats", "--url", "ftp://nowhere") == 1
    assert _main("stats", "--url", "shm://elsewhere/kv") == 1
    assert "failed" in capsys.readouterr().err
    # an arena that does not exist is reported, not created (the CLI knows no payload size)
    assert _main("stats", "--url", f"shm://{tmp_path}", "--fingerprint", FPS[0]) == 1
    assert "payload_bytes is needed" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
    assert _main("stats", "--url", f"shm://{tmp_path}/none") == 0  # no namespace: nothing to do
