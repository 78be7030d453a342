"""``pdserve router`` on its own with a busy port: one line naming the port and the flag."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


@pytest.mark.parametrize(("flag", "other"), [("--port", "--grpc-port"), ("--grpc-port", "--port")])
def test_a_busy_port_is_one_line_naming_its_flag(busy_port: int, flag: str, other: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "router", flag, str(busy_port), other, "0"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    ours = [line for line in done.stderr.splitlines() if line.startswith("pdserve router:")]
    assert len(ours) == 1 and f":{busy_port} " in ours[0] and f"({flag} changes" in ours[0]
    assert "Traceback" not in done.stderr and "Event loop is closed" not in done.stderr


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_node_on_a_busy_port_says_which_flag(busy_port: int, kind: str, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", kind, "--port", str(busy_port),
         "--kv-store", f"file://{tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{busy_port} (--port changes it)" in done.stderr
    assert "Traceback" not in done.stderr
