"""``pdserve up`` with real processes: a busy port is one line; SIGKILL of `up` leaves no process
and no /dev/shm directory behind; ``pdserve down`` stops a running cluster; vLLM's engine flags
reach the nodes (``--max-model-len 512``: a longer prompt is refused)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.launcher.cluster_harness import REPO, UpProcess, wait_until

pytestmark = pytest.mark.slow


def _pdserve(*argv: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve_cli", *argv],
        cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip


@pytest.mark.parametrize(("flag", "what"), [("--port", "HTTP"), ("--grpc-port", "gRPC")])
def test_a_busy_router_port_is_one_line(flag: str, what: str, tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        other = "--grpc-port" if flag == "--port" else "--port"
        done = _pdserve("up", flag, str(port), other, "0", "--state-dir", str(tmp_path))
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, lines
    assert f"port {port} (router {what})" in lines[0] and f"{flag} PORT" in lines[0]
    assert list(tmp_path.iterdir()) == []  # nothing was started


def test_a_busy_node_port_is_one_line(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = _pdserve("up", "--port", "0", "--grpc-port", "0", "--state-dir", str(tmp_path),
                        "--node-args", f"--port {port}", timeout_s=300.0)  # fmt: skip
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, lines
    assert f"could not bind port {port} (in use)" in lines[0] and "--node-args" in lines[0]
    progress = done.stdout.strip().splitlines()  # what it did until then, a line a phase
    assert progress and all(line.startswith("pdserve up [") for line in progress), progress
    assert list(tmp_path.iterdir()) == []  # the state file went with the cluster


def test_sigkill_of_up_leaves_nothing_behind(tmp_path: Path) -> None:
    up = UpProcess(tmp_path / "logs")
    try:
        up.wait_ready()
        workdir = up.workdir()
        assert workdir is not None and workdir.exists()
        assert len(up.leftovers()) >= 6  # up, its reaper, router, 2 nodes, 2 engine cores
        assert len(list(up.state_dir.glob("*.json"))) == 1
        up.proc.kill()
        up.proc.wait()
        wait_until(lambda: up.leftovers() == [], 10.0, "every process of the cluster to go")
    except BaseException:
        up.kill()
        raise
    assert not workdir.exists()
    assert list(up.state_dir.iterdir()) == []
    wait_until(lambda: "exited without stopping its cluster" in up.output, 5.0, "reaper's line")


def test_engine_flags_reach_the_nodes_and_down_stops_the_cluster(tmp_path: Path) -> None:
    up = UpProcess(tmp_path / "logs", "--max-model-len", "512", "--served-model-name", "tiny")
    try:
        url = up.wait_ready()
        said = "\n".join(up.lines)  # a line per start-up phase, before the banner
        for phase in ("] model tiny-llama: LlamaForCausalLM, context 512", "] KV store shm://",
                      "] router serving on", "] registered: prefill 1/1, decode 1/1"):  # fmt: skip
            assert phase in said, said
        for role in ("prefill", "decode"):
            (pid,) = up.pids_running(role, "--max-model-len")
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            assert argv[argv.index("--max-model-len") + 1] == "512"
        with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
            short = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
            assert client.post("/v1/completions", json=short).status_code == 200
            long = {**short, "prompt": "hello " * 600}  # > 512 tokens
            refused = client.post("/v1/completions", json=long)
            assert refused.status_code == 400 and "512" in refused.text, refused.text
        workdir = up.workdir()
        spared = _pdserve("down", "--state-dir", str(up.state_dir), timeout_s=180.0)
        assert spared.returncode == 0 and "is running: left alone" in spared.stdout, spared
        assert up.proc.poll() is None  # plain `down` stops orphans only
        done = _pdserve("down", "--all", "--state-dir", str(up.state_dir), timeout_s=180.0)
        assert done.returncode == 0 and "(up stopped it)" in done.stdout, done
        assert up.wait_exit() == 0, up.output  # a graceful stop, as on Ctrl-C
    except BaseException:
        up.kill()
        raise
    assert up.leftovers() == [] and workdir is not None and not workdir.exists()
    assert list(up.state_dir.iterdir()) == []
