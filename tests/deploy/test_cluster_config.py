"""`pdserve up` configuration and process helpers, without starting a cluster."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from common.cli import build_parser
from router.cluster_config import ClusterConfig
from router.processes import child_env, connect_host, kill_marked, marked_pids, parse_ready


def config(*argv: str) -> ClusterConfig:
    return ClusterConfig.from_args(build_parser().parse_args(["up", *argv]))


def test_defaults_bind_loopback_and_use_a_shm_arena() -> None:
    c = config()
    assert (c.host, c.port, c.grpc_port, c.kv_store, c.model) == (
        "127.0.0.1", 8000, 50051, "shm", "tiny-llama",
    )  # fmt: skip
    assert c.kv_store_capacity == "4GiB"
    assert config("--kv-store", "redis+cluster://127.0.0.1:7000").kv_store.startswith("redis+")
    assert (c.prefill, c.decode, c.autoscale, c.demo) == (1, 1, False, False)


def test_cpu_nodes_get_one_thread_and_user_flags_last() -> None:
    c = config("--device", "cpu", "--node-args", "--max-num-seqs 4")
    assert c.node_argv() == ["--device", "cpu", "--cpu-threads", "1", "--max-num-seqs", "4"]


def test_gpu_nodes_sharing_a_gpu_get_a_kv_budget() -> None:
    shared = config("--device", "cuda", "--prefill", "2", "--decode", "2")
    assert shared.node_argv() == ["--device", "cuda", "--kv-cache-memory-gb", "4"]
    own = config("--device", "cuda", "--gpus", "0,1", "--prefill", "1", "--decode", "1")
    assert own.gpus == ("0", "1") and own.node_argv() == ["--device", "cuda"]
    sized = config("--device", "cuda", "--kv-cache-gb", "12.5")
    assert sized.node_argv()[-2:] == ["--kv-cache-memory-gb", "12.5"]


@pytest.mark.parametrize(
    "argv",
    [
        ("--kv-store", "mongodb://x"),
        ("--prefill", "0"),
        ("--autoscale", "--prefill-min", "3", "--prefill-max", "2"),
        ("--slo", "ttft=fast"),
    ],
)
def test_bad_flags_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        config(*argv)


def test_ready_line_and_connect_host() -> None:
    assert parse_ready("PDSERVE_READY http_port=1 grpc_port=2\n") == {
        "http_port": "1",
        "grpc_port": "2",
    }
    assert parse_ready("INFO something else") is None
    assert [connect_host(h) for h in ("0.0.0.0", "::", "10.0.0.5", "fe80::1")] == [
        "127.0.0.1", "[::1]", "10.0.0.5", "[fe80::1]",
    ]  # fmt: skip


def test_child_env_scrubs_pdserve_variables_but_the_cache_dir() -> None:
    base = {"PDSERVE_PREFILL": "2", "PDSERVE_CACHE_DIR": "/c", "PATH": "/bin"}
    env = child_env("m1", base, scrub_pdserve=True, PDSERVE_API_KEY="k")
    expected = {"PDSERVE_CACHE_DIR": "/c", "PATH": "/bin", "_PDSERVE_CLUSTER": "m1"}
    assert env == {**expected, "PDSERVE_API_KEY": "k"}


CHILD_WITH_GRANDCHILD = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""


def test_kill_marked_finds_descendants_by_their_environment() -> None:
    marker = uuid.uuid4().hex
    parent = subprocess.Popen(
        [sys.executable, "-c", CHILD_WITH_GRANDCHILD], env=child_env(marker), start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60.0
        while len(marked_pids(marker)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the grandchild to exist
        assert len(marked_pids(marker)) == 2
        assert len(kill_marked(marker)) == 2
    finally:
        kill_marked(marker)
        parent.wait()
    assert marked_pids(marker) == []


def test_kill_marked_grace_lets_stragglers_exit_and_kills_the_rest() -> None:
    marker = uuid.uuid4().hex
    quick = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(0.5)"], env=child_env(marker)
    )
    try:
        assert kill_marked(marker, grace_s=30.0) == []  # it left on its own within the grace
        assert quick.wait(timeout=5) == 0
        stuck = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], env=child_env(marker)
        )
        start = time.monotonic()
        assert kill_marked(marker, grace_s=0.3) == [stuck.pid]
        assert stuck.wait(timeout=5) == -9 and time.monotonic() - start < 10
    finally:
        kill_marked(marker)
    assert marked_pids(marker) == []
