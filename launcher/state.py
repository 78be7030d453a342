"""The state file of a running ``pdserve up``: what ``pdserve down`` (and `up`'s reaper) need to
stop the cluster and clean up after it when `up` itself cannot.

One JSON file per cluster, ``<state dir>/<up pid>.json`` (default state dir:
``<pdserve cache dir>/clusters``), written when `up` starts, rewritten once its processes are
known, removed when the cluster is gone. It names `up` (pid and start time, so a recycled pid is
not mistaken for it), the cluster marker every child carries in its environment, the child
process groups, and the directories to remove (the KV store and logs under /dev/shm).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from common.cache_dir import default_cache_root


def default_state_dir() -> Path:
    return default_cache_root() / "clusters"


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot); None if it is gone or a
    zombie (it exited, its parent has not reaped it yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = stat.rsplit(b")", 1)[1].split()  # fields 3… of proc(5)
    return None if fields[0] == b"Z" else int(fields[19])


@dataclass
class ClusterState:
    """One cluster, as `up` records it."""

    up_pid: int
    up_start_time: int | None
    marker: str  # _PDSERVE_CLUSTER=<marker> in every child's environment
    workdir: str  # removed with the cluster (the KV store, logs unless --log-dir, TMPDIR)
    http_url: str = ""
    process_groups: list[int] = field(default_factory=list)  # a child's pid = its group id

    def up_alive(self) -> bool:
        """Is the `up` process that wrote this still running?"""
        started = process_start_time(self.up_pid)
        return started is not None and started == self.up_start_time


def state_path(state_dir: Path, up_pid: int) -> Path:
    return state_dir / f"{up_pid}.json"


def write_state(state_dir: Path, state: ClusterState) -> Path:
    """Write (replace atomically) the state file of ``state``; its path."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_path(state_dir, state.up_pid)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(asdict(state), indent=1))
    tmp.replace(path)
    return path


def read_states(state_dir: Path) -> list[tuple[Path, ClusterState]]:
    """Every readable state file in ``state_dir`` (unreadable ones are skipped)."""
    found = []
    for path in sorted(state_dir.glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            found.append((path, ClusterState(**json.loads(path.read_text()))))
    return found


def remove_state(path: Path) -> None:
    path.unlink(missing_ok=True)
