"""Child processes of ``pdserve up`` and of the local actuator: start, await ready, stop, sweep.

Every child runs in its own session (``start_new_session``): a terminal's Ctrl-C reaches only
the parent, which then stops the children in order, and one ``killpg`` ends a child together with
what it started (a node and its engine-core process). Every child's environment also carries
``_PDSERVE_CLUSTER=<id>``, which its descendants inherit, so :func:`kill_marked` finds whatever
is left of a cluster by reading ``/proc/<pid>/environ`` - no process-tree bookkeeping, and
nothing outside the cluster is ever touched.

Every child also dies with the process that started it, however that one dies (SIGKILL
included): the kernel sends it SIGKILL when its parent exits (``PR_SET_PDEATHSIG``, set between
fork and exec by ``common.parent_death.die_with_parent``). What a child started in turn (a node's engine core)
watches its own parent; `up`'s reaper (``launcher.reaper``) sweeps whatever is left.

A pdserve service prints ``PDSERVE_READY key=value ...`` on stdout once it serves;
:meth:`ManagedProcess.wait_ready` returns those pairs. Everything else a child writes goes to its
log file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from common.parent_death import die_with_parent

READY_PREFIX = "PDSERVE_READY"
CLUSTER_ENV = "_PDSERVE_CLUSTER"
_POLL_S = 0.05
_TRACKER_GRACE_S = 2.0  # for a resource tracker to clean up once its processes are gone


class StartupError(RuntimeError):
    """A child exited, or did not report ready in time; the message holds its log's tail."""


def parse_ready(line: str) -> dict[str, str] | None:
    """``"PDSERVE_READY port=50061"`` → ``{"port": "50061"}``; None for any other line."""
    if not line.startswith(READY_PREFIX):
        return None
    pairs = (item.partition("=") for item in line[len(READY_PREFIX) :].split())
    return {key: value for key, sep, value in pairs if sep}


def child_env(
    marker: str, base: Mapping[str, str] | None = None, scrub_pdserve: bool = False, **extra: str
) -> dict[str, str]:
    """The environment of a cluster child: ``base`` (default: ours) plus the cluster marker and
    ``extra``. ``scrub_pdserve`` drops ``PDSERVE_*`` overrides (all but ``PDSERVE_CACHE_DIR``)
    for a parent that passes every setting as a flag."""
    env = dict(os.environ if base is None else base)
    if scrub_pdserve:
        env = {
            k: v for k, v in env.items() if not k.startswith("PDSERVE_") or k == "PDSERVE_CACHE_DIR"
        }
    env[CLUSTER_ENV] = marker
    env.update(extra)
    return env


class ManagedProcess:
    """One child in its own session, dying with this process (:func:`die_with_parent`).
    ``argv`` runs with stdin closed, stderr (and stdout other than the ready line) appended to
    ``log_path``. Construction starts it; nothing blocks."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: Mapping[str, str],
        cwd: Path | None = None,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self.ready_info: dict[str, str] | None = None
        self._ready = threading.Event()
        with log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=log,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
                preexec_fn=die_with_parent(),
            )
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        with self.log_path.open("ab") as log:
            for raw in self.proc.stdout:
                info = parse_ready(raw.decode(errors="replace"))
                if info is not None and self.ready_info is None:
                    self.ready_info = info
                    self._ready.set()
                else:
                    log.write(raw)
                    log.flush()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    async def wait_ready(self, timeout_s: float) -> dict[str, str]:
        """The ready line's pairs; raises StartupError if the child exits or ``timeout_s``
        passes first (the child is left running: stop it)."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.is_set():
            if not self.alive:
                raise StartupError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StartupError(f"{self.name} not ready after {timeout_s:.0f} s")
            await asyncio.sleep(_POLL_S)
        assert self.ready_info is not None
        return self.ready_info

    def terminate(self) -> None:
        """SIGTERM to the child itself (a pdserve service then drains and exits)."""
        if self.alive:
            _signal_pid(self.pid, signal.SIGTERM)

    def kill_group(self) -> None:
        """SIGKILL to the child's whole process group (whatever of it is still there)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.alive:
            _signal_pid(self.pid, signal.SIGKILL)

    def kill_orphans(self) -> None:
        """After the child itself exited: SIGKILL what is left of its process group but its
        resource trackers, which remove the named semaphores the group left (``/dev/shm/sem.*``)
        and exit on their own once their parent is gone (see :func:`kill_marked`)."""
        for pid in group_pids(self.pid):
            if not _is_resource_tracker(pid):
                _signal_pid(pid, signal.SIGKILL)

    async def wait_exit(self, timeout_s: float) -> int | None:
        """The exit status, or None if still running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.alive and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)
        return self.proc.poll()

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, wait up to ``timeout_s``, then SIGKILL the group; returns the exit status
        of a graceful exit, None when it had to be killed."""
        self.terminate()
        code = await self.wait_exit(timeout_s)
        self.kill_group()
        if code is None:
            self.proc.wait()
        return code

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b[^:]*: .+")


def last_error(log: str) -> str:
    """The line of a child's log that says why it failed: the last ``SomeError: why`` line
    (a Python traceback ends with it), else the last line that says anything."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def connect_host(host: str) -> str:
    """Where a process on this machine reaches a server bound to ``host`` (URL-ready)."""
    if host == "0.0.0.0":  # a wildcard someone asked for: reach it on loopback
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def marked_pids(marker: str) -> list[int]:
    """Live processes (other than this one) whose environment holds ``_PDSERVE_CLUSTER=marker``.

    Zombies have an empty environ and are not listed (they run nothing)."""
    needle = f"{CLUSTER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def kill_marked(marker: str, timeout_s: float = 10.0, grace_s: float = 0.0) -> list[int]:
    """SIGKILL every process of the cluster ``marker`` until none is left (or ``timeout_s``);
    returns the pids that had to be killed.

    ``grace_s``: first wait that long for them to go on their own. After a graceful stop what
    is left is normally a helper about to exit (multiprocessing's resource tracker, say, leaves
    once its parent's pipe closes); killing it would report a hung process that was not one.

    Resource trackers go last: once the processes they serve are gone, a tracker removes the
    named semaphores those left (``/dev/shm/sem.mp-*``: an engine core makes one) and exits;
    killed together with them, it would leave the files behind. It gets ``_TRACKER_GRACE_S``."""
    grace_end = time.monotonic() + grace_s
    while marked_pids(marker) and time.monotonic() < grace_end:
        time.sleep(_POLL_S)
    killed: list[int] = []
    deadline = time.monotonic() + timeout_s
    trackers_until = 0.0
    while (pids := marked_pids(marker)) and time.monotonic() < deadline:
        targets = [pid for pid in pids if not _is_resource_tracker(pid)]
        if targets:
            trackers_until = time.monotonic() + _TRACKER_GRACE_S
        elif time.monotonic() > trackers_until:
            targets = pids
        for pid in targets:
            _signal_pid(pid, signal.SIGKILL)
        killed += [p for p in targets if p not in killed]
        time.sleep(_POLL_S)
    return killed


def group_pids(pgid: int) -> list[int]:
    """Live processes of process group ``pgid`` (from ``/proc/<pid>/stat``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _is_resource_tracker(pid: int) -> bool:
    try:
        return b"multiprocessing.resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
