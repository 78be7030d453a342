"""``pdserve down``: stop the clusters ``pdserve up`` left running, from their state files.

    pdserve down                 # orphans only: clusters whose `up` is gone
    pdserve down --pid 12345     # the cluster of the `up` process 12345, running or not
    pdserve down --all           # every cluster recorded, running ones too

A cluster whose ``up`` still runs is someone's live cluster: plain ``down`` reports it and
leaves it alone (stop it with Ctrl-C in its terminal, ``--pid`` or ``--all``).

For each cluster: if its `up` still runs, it gets SIGTERM and ``--timeout`` seconds to stop the
cluster gracefully (as Ctrl-C would), then SIGKILL. Then whatever of the cluster is still alive
is killed (found by the marker in its environment, see ``launcher.processes``), its directory
(KV store, logs, temporary files under /dev/shm) is removed, and so is its state file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

from launcher.processes import CLUSTER_ENV, kill_marked
from launcher.state import ClusterState, default_state_dir, read_states, remove_state

_POLL_S = 0.1


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``down`` subcommand."""
    parser = subparsers.add_parser(
        "down",
        help="stop orphaned clusters of pdserve up; --all or --pid for running ones",
        description="Stop the clusters of `pdserve up` whose `up` process is gone (orphans) and"
        " remove their files. A cluster whose `up` still runs is left alone unless --all or"
        " --pid names it.",
    )
    selection = parser.add_mutually_exclusive_group()
    selection.add_argument("--pid", type=int, default=None,
                           help="only the cluster of this `up` pid, running or not")  # fmt: skip
    selection.add_argument("--all", action="store_true",
                           help="every recorded cluster, running ones too")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds a running `up` gets to stop its cluster (default 60)")  # fmt: skip
    parser.add_argument("--state-dir", default=None,
                        help="where `up` records its clusters (default <cache dir>/clusters)")  # fmt: skip
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir()
    clusters = [(p, s) for p, s in read_states(state_dir) if args.pid in (None, s.up_pid)]
    if not clusters:
        print(f"pdserve down: no cluster recorded in {state_dir}")
        return 0
    for path, state in clusters:
        if args.pid is None and not args.all and state.up_alive():
            print(
                f"pdserve down: cluster of up pid {state.up_pid} is running: left alone"
                f" (pdserve down --pid {state.up_pid} stops it)",
                flush=True,
            )
            continue
        print(f"pdserve down: {stop_cluster(path, state, args.timeout)}", flush=True)
    return 0


def stop_cluster(path: Path, state: ClusterState, timeout_s: float) -> str:
    """Stop the cluster of ``state`` and remove its files; a line saying what was done."""
    how = "up was gone"
    if state.up_alive():
        how = "up stopped it" if _stop_up(state, timeout_s) else "up killed"
    killed = kill_marked(state.marker) + _kill_groups(state)
    removed = _remove_workdir(state)
    remove_state(path)
    parts = [f"cluster of up pid {state.up_pid} ({how})", f"killed {len(killed)} process(es)"]
    if removed:
        parts.append(f"removed {removed}")
    return ", ".join(parts)


def _stop_up(state: ClusterState, timeout_s: float) -> bool:
    """SIGTERM to `up`; True if it exited within ``timeout_s``, else it gets SIGKILL."""
    _signal(state.up_pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while state.up_alive():
        if time.monotonic() > deadline:
            _signal(state.up_pid, signal.SIGKILL)
            return False
        time.sleep(_POLL_S)
    return True


def _kill_groups(state: ClusterState) -> list[int]:
    """SIGKILL to the recorded process groups whose leader is still the cluster's."""
    killed = []
    for pgid in state.process_groups:
        if _carries_marker(pgid, state.marker):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
                killed.append(pgid)
    return killed


def _carries_marker(pid: int, marker: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False
    return f"{CLUSTER_ENV}={marker}".encode() in environ.split(b"\0")


def _remove_workdir(state: ClusterState) -> str | None:
    """Remove the cluster's directory, if it is one `up` made (``pdserve-<pid>-…``)."""
    workdir = Path(state.workdir)
    if not re.fullmatch(rf"pdserve-{state.up_pid}-\w+", workdir.name) or not workdir.exists():
        return None
    shutil.rmtree(workdir, ignore_errors=True)
    return str(workdir)


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
