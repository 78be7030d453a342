"""Start-up latency a user sees: ``pdserve --help`` (and each subcommand's), and the time from
``pdserve up`` to its first completion on the built-in tiny model.

    python benchmarks/startup.py                  # --help times, then 3 `up` runs (warm cache)
    python benchmarks/startup.py --cold           # each `up` with an empty pdserve cache dir
    python benchmarks/startup.py --runs 5 --repo /other/checkout

``--help``: wall time of ``python -m pdserve_cli [CMD] --help`` in a fresh interpreter, median
(and min) of ``--help-runs``. First completion: ``pdserve up --port P --grpc-port G`` started, a
``/v1/completions`` request (8 tokens) polled every 50 ms until one succeeds, as a user with
``curl`` in a loop would; the time from starting `up` to that reply. ``--cold`` gives every run
a fresh ``PDSERVE_CACHE_DIR``: the tiny model is generated and the CPU kernel compiled first.
Every line carries the load average, since a shared box changes every figure.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

COMMANDS = ["", "up", "down", "prefill", "decode", "router", "bench", "health", "kv-store", "demo"]
BODY = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 8}


def _load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def _env(repo: Path, **extra: str) -> dict[str, str]:
    path = os.pathsep.join(
        filter(None, [str(repo), str(repo / "proto"), os.environ.get("PYTHONPATH")])
    )
    return {**os.environ, "PYTHONPATH": path, **extra}


def help_times(repo: Path, runs: int) -> None:
    print("| command | median (s) | min (s) | load |\n| --- | ---: | ---: | ---: |")
    for command in COMMANDS:
        argv = [sys.executable, "-m", "pdserve_cli", *([command] if command else []), "--help"]
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            subprocess.run(argv, cwd=repo, env=_env(repo), capture_output=True, check=True)
            times.append(time.perf_counter() - start)
        name = f"pdserve {command}".strip()
        print(
            f"| `{name} --help` | {statistics.median(times):.2f} | {min(times):.2f} | {_load()} |"
        )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def first_completion(repo: Path, cold: bool, timeout_s: float = 600.0) -> float:
    """Seconds from starting `pdserve up` to its first successful completion."""
    port, grpc_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="pdserve-startup-") as tmp:
        extra = {"PDSERVE_CACHE_DIR": tmp} if cold else {}
        argv = [sys.executable, "-m", "pdserve_cli", "up", "--port", str(port),
                "--grpc-port", str(grpc_port)]  # fmt: skip
        start = time.perf_counter()
        up = subprocess.Popen(argv, cwd=repo, env=_env(repo, **extra),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            return _poll(f"http://127.0.0.1:{port}", up, start, timeout_s)
        finally:
            up.send_signal(signal.SIGINT)
            up.wait(120)


def _poll(url: str, up: subprocess.Popen[bytes], start: float, timeout_s: float) -> float:
    with httpx.Client(base_url=url, timeout=60.0, trust_env=False) as client:
        while time.perf_counter() - start < timeout_s:
            if up.poll() is not None:
                raise RuntimeError(f"pdserve up exited with {up.returncode}")
            try:
                if client.post("/v1/completions", json=BODY).status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError("no completion before the timeout")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--runs", type=int, default=3, help="`up` runs")
    parser.add_argument("--help-runs", type=int, default=5)
    parser.add_argument("--cold", action="store_true", help="a fresh cache dir for every `up`")
    parser.add_argument("--no-help", action="store_true", help="skip the --help times")
    args = parser.parse_args()
    if not args.no_help:
        help_times(args.repo, args.help_runs)
    cache = "cold cache" if args.cold else "warm cache"
    for i in range(args.runs):
        seconds = first_completion(args.repo, args.cold)
        print(f"up -> first completion ({cache}), run {i + 1}: {seconds:.2f} s (load {_load()})")


if __name__ == "__main__":
    main()
