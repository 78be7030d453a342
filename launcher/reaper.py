"""The reaper: a small watchdog process that `pdserve up` starts first, and that cleans up the
cluster when `up` dies without doing it (SIGKILL, a crash, the OOM killer).

Its stdin is a pipe whose only write end `up` holds. A normal stop cleans up in `up`, which then
writes ``done`` and closes the pipe: the reaper exits. If `up` dies, the kernel closes the pipe;
the reaper reads end-of-file without ``done`` and kills every process of the cluster (found by
its marker, ``launcher.processes.kill_marked``), removes the cluster's directory and state file,
and says so in one line on stderr.

`up`'s own children do not wait for the reaper: the kernel kills them as `up` dies
(``PR_SET_PDEATHSIG``). The reaper catches what they started (engine cores) and the files. It
runs in its own session and without the cluster marker, so neither a terminal's Ctrl-C nor the
sweep reaches it.

    python -m launcher.reaper --marker M --workdir DIR --state-file FILE   (stdin: the pipe)
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from launcher.processes import CLUSTER_ENV, kill_marked

DONE = b"done"
GRACE_S = 5.0


class Reaper:
    """The reaper of one cluster, started at construction."""

    def __init__(self, marker: str, workdir: Path, state_file: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k != CLUSTER_ENV}
        argv = [sys.executable, "-m", "launcher.reaper", "--marker", marker,
                "--workdir", str(workdir), "--state-file", str(state_file)]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, start_new_session=True
        )

    def dismiss(self, timeout_s: float = 10.0) -> None:
        """The cluster is cleaned up: let the reaper go, and wait for it to exit."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(DONE)
            self.proc.stdin.close()
        except OSError:  # it died already
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def reap(marker: str, workdir: Path, state_file: Path, grace_s: float = GRACE_S) -> str:
    """Kill what is left of the cluster and remove its files; the one line to say so.

    What is left first gets ``grace_s`` to go on its own: an engine core leaves within a second
    of its node's death (it watches its parent) and closes its store and sockets on the way;
    only what is still there after that is killed."""
    killed = kill_marked(marker, grace_s=grace_s)
    shutil.rmtree(workdir, ignore_errors=True)
    state_file.unlink(missing_ok=True)
    return (
        f"pdserve up exited without stopping its cluster: killed {len(killed)} process(es),"
        f" removed {workdir}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.reaper")
    parser.add_argument("--marker", required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--state-file", type=Path, required=True)
    args = parser.parse_args(argv)
    if sys.stdin.buffer.read() == DONE:  # blocks until `up` lets go or dies
        return 0
    print(reap(args.marker, args.workdir, args.state_file), file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
