"""A ``pdserve up`` process for tests: start, read its endpoints, query it, stop it, and prove
nothing of it is left running.

Every process of the cluster inherits ``UP_TEST_TAG=<uuid>`` from the environment of `up`
(which scrubs only ``PDSERVE_*`` variables), so :meth:`UpProcess.leftovers` finds any survivor by
scanning ``/proc/<pid>/environ`` - no psutil, no process-tree bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 400.0  # router + nodes cold-starting on a loaded 2-core machine
_URL = re.compile(r"OpenAI HTTP\s+(\S+)/v1")


class UpProcess:
    """``python -m pdserve_cli up --port 0 --grpc-port 0 --log-dir LOGS --state-dir STATE *args``
    (a state dir of its own: a `pdserve down` elsewhere never stops a test's cluster)."""

    def __init__(self, log_dir: Path, *args: str) -> None:
        self.tag = uuid.uuid4().hex
        self.log_dir = log_dir
        self.args = args  # the `up` flags
        self.state_dir = log_dir.parent / f"state-{self.tag[:8]}"
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "UP_TEST_TAG": self.tag, "PYTHONPATH": path}
        cmd = [sys.executable, "-m", "pdserve_cli", "up", "--port", "0", "--grpc-port", "0"]
        self.proc = subprocess.Popen(
            [*cmd, "--log-dir", str(log_dir), "--state-dir", str(self.state_dir), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            match = _URL.search(line)
            if match and self.url is None:
                self.url = match.group(1)
                self._ready.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """The router's base URL, once `up` printed its endpoints."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"pdserve up did not start:\n{self.output}\n{self.logs()}")
        assert self.url is not None
        return self.url

    def wait_exit(self, timeout_s: float = 180.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"pdserve up did not exit:\n{self.output}") from None

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Ctrl-C (or ``sig``) to `up` alone, as a terminal would; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit()

    def kill(self) -> None:
        """Last resort for a failed test: SIGKILL every process of this cluster."""
        for pid in [self.proc.pid, *self.leftovers()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        workdir = self.workdir()
        if workdir:  # `up` was killed before it could remove its temporary directory
            shutil.rmtree(workdir, ignore_errors=True)

    def workdir(self) -> Path | None:
        """The cluster's temporary directory (KV store, TMPDIR), from the printed endpoints."""
        found = re.search(r"KV store\s+(?:file|shm)://(/\S+/pdserve-[^/\s]+)/kv", self.output)
        return Path(found.group(1)) if found else None

    def pids_running(self, *words: str) -> list[int]:
        """This cluster's processes whose command line holds every one of ``words``."""
        found = []
        for pid in self.leftovers():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except OSError:
                continue
            if all(word in argv for word in words):
                found.append(pid)
        return found

    def leftovers(self) -> list[int]:
        """Pids of live processes (not zombies) carrying this cluster's tag."""
        needle = f"UP_TEST_TAG={self.tag}".encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found

    def logs(self, lines: int = 25) -> str:
        tails = []
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(tails)


def health(client: httpx.Client) -> dict[str, int]:
    """Routable instances per pool, from the router's /health."""
    return dict(client.get("/health").json()["instances"])


def autoscaler_targets(client: httpx.Client) -> dict[str, float]:
    """``pdserve_autoscaler_target_instances`` per pool, from /metrics."""
    text = client.get("/metrics").text
    pattern = re.compile(r'^pdserve_autoscaler_target_instances\{pool="(\w+)"\} (\S+)$', re.M)
    return {pool: float(value) for pool, value in pattern.findall(text)}


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` every 0.2 s (a readiness poll, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.2)
