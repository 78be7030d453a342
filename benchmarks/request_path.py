"""The path of one request, counted: the processes, files and functions of pdserve it runs
through, the prompt's block hashes computed in each process, and the KV-store round trips.

Starts a router, a prefill node and a decode node (tiny-llama, file store, real processes) with
a call recorder (``request_path_hook/sitecustomize.py``) in each, sends a warm-up request, then
records one streamed ``POST /v1/completions`` end to end. An idle window of the same length is
recorded first: what runs in it (heartbeats, polling) is background, listed apart.

    python benchmarks/request_path.py [--prompt-tokens 40] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).resolve().parent / "request_path_hook"
HASH_FUNCTIONS = {
    ("common/block_hash.py", "hash_block"),
    ("common/block_hash.py", "hash_partial_block"),
}
STORE_CALLS = {"put_many", "get_many_into", "get_many", "contains_many", "delete_many"}
STORE_FILES = ("kv_store/redis_store.py", "kv_store/file_store.py", "kv_store/arena_store.py")


class Process:
    """A ``pdserve`` subcommand in its own process; its PDSERVE_READY line's fields."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve_cli", "--log-level", "WARNING", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True,
        )  # fmt: skip
        self.ready: dict[str, str] = {}
        self._event = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PDSERVE_READY") and not self._event.is_set():
                self.ready = dict(part.split("=", 1) for part in line.split()[1:])
                self._event.set()

    def wait_ready(self, timeout_s: float = 300.0) -> dict[str, str]:
        if not self._event.wait(timeout_s) or self.proc.poll() is not None:
            raise RuntimeError(f"{self.proc.args} did not start")
        return self.ready

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@dataclass
class Trace:
    """One process's recorded calls: (time, repo-relative file, function)."""

    pid: int
    ppid: int
    argv: list[str]
    calls: list[tuple[float, str, str]] = field(default_factory=list)

    def window(self, start: float, end: float) -> list[tuple[str, str]]:
        return [(f, fn) for t, f, fn in self.calls if start <= t <= end]


def wait_all_recording(trace_dir: Path, on: bool, timeout_s: float = 60.0) -> None:
    """Until every traced process has said it switched recording ``on`` (or off)."""
    marker = json.dumps({"on": on})[:-1]  # '{"on": true' prefix of the process's line
    deadline = time.monotonic() + timeout_s
    while not all(
        marker in path.read_text() or not _alive(int(path.stem))
        for path in trace_dir.glob("*.jsonl")
    ):
        if time.monotonic() > deadline:
            raise RuntimeError(f"a traced process did not switch recording {on}")
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def read_traces(trace_dir: Path) -> list[Trace]:
    traces = []
    for path in sorted(trace_dir.glob("*.jsonl")):
        lines = path.read_text().splitlines()
        header = json.loads(lines[0])
        trace = Trace(header["pid"], header["ppid"], header["argv"])
        trace.calls = [tuple(json.loads(line)) for line in lines[1:] if line.startswith("[")]
        traces.append(trace)
    return traces


def role_of(trace: Trace, roles: dict[int, str]) -> str:
    if trace.pid in roles:
        return roles[trace.pid]
    if trace.ppid in roles:  # an engine-core process, spawned by its node
        return f"{roles[trace.ppid]} engine core"
    return f"pid {trace.pid}"


def stream_completion(base_url: str, prompt: list[int], max_tokens: int) -> int:
    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    events = 0
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            events += line.startswith("data: ")
    return events


def run(args: argparse.Namespace) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix="pdserve-path-"))
    trace_dir = work / "trace"
    trace_dir.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HOOK), str(REPO), str(REPO / "proto")]),
        "PDSERVE_TRACE_DIR": str(trace_dir),
        "PDSERVE_TRACE_ROOT": str(REPO),
        "OMP_NUM_THREADS": "1",
    }
    store = f"file://{work / 'kv'}"
    router = Process(
        ["router", "--port", "0", "--grpc-port", "0", "--heartbeat-interval", "30",
         "--heartbeat-timeout", "120"], env, work / "router.log",
    )  # fmt: skip
    ready = router.wait_ready()
    base_url = f"http://127.0.0.1:{ready['http_port']}"
    node_flags = ["--port", "0", "--kv-store", store, "--router", f"127.0.0.1:{ready['grpc_port']}"]
    nodes = {kind: Process([kind, *node_flags], env, work / f"{kind}.log") for kind in ("prefill", "decode")}  # fmt: skip
    try:
        for node in nodes.values():
            node.wait_ready()
        deadline = time.monotonic() + 120
        while httpx.get(f"{base_url}/health").json().get("instances") != {
            "prefill": 1,
            "decode": 1,
        }:
            if time.monotonic() > deadline:
                raise RuntimeError("nodes did not register")
            time.sleep(0.2)
        prompt = [(7 * i + 3) % 200 + 10 for i in range(args.prompt_tokens)]
        stream_completion(base_url, [t + 1 for t in prompt], args.max_tokens)  # warm-up
        time.sleep(1.0)
        on = trace_dir / "on"
        on.touch()
        wait_all_recording(trace_dir, True)
        idle_start = time.time()
        time.sleep(args.idle_s)
        idle_end = start = time.time()
        events = stream_completion(base_url, prompt, args.max_tokens)
        end = time.time()
        time.sleep(0.2)
        on.unlink()
        wait_all_recording(trace_dir, False)
    finally:
        for proc in (*nodes.values(), router):
            proc.stop()
    roles = {router.proc.pid: "router", **{n.proc.pid: kind for kind, n in nodes.items()}}
    report: dict[str, object] = {"stream_events": events, "seconds": round(end - start, 3)}
    processes = {}
    for trace in read_traces(trace_dir):
        calls = trace.window(start, end + 0.1)  # + the last flush of the stream's end
        if not calls:
            continue
        background = {f for f, _ in trace.window(idle_start, idle_end)}
        files = Counter(f for f, _ in calls)
        processes[role_of(trace, roles)] = {
            "files": sorted(files),
            "num_files": len(files),
            "num_functions": len({c for c in calls}),
            "background_files": sorted(background),
            "block_hashes": sum(1 for c in calls if c in HASH_FUNCTIONS),
            "store_calls": dict(
                Counter(fn for f, fn in calls if f in STORE_FILES and fn in STORE_CALLS)
            ),
        }
    report["processes"] = processes
    report["num_processes"] = len(processes)
    report["num_files"] = len({f for p in processes.values() for f in p["files"]})  # type: ignore[attr-defined]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--idle-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = parser.parse_args()
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(
        f"one streamed /v1/completions: {report['stream_events']} SSE events in {report['seconds']} s"
    )
    print(f"{report['num_processes']} processes, {report['num_files']} distinct files of pdserve")
    for role, p in report["processes"].items():  # type: ignore[union-attr]
        print(f"  {role:22s} {p['num_files']:3d} files {p['num_functions']:4d} functions"
              f"  block hashes {p['block_hashes']:3d}  store calls {p['store_calls']}")  # fmt: skip
        for name in p["files"]:
            mark = "  (also idle)" if name in p["background_files"] else ""
            print(f"      {name}{mark}")


if __name__ == "__main__":
    main()
