"""Ports and process lifetime of ``pdserve up`` without a cluster: held ports and their one-line
error, children dying with their parent (the race before ``prctl`` included), the reaper, and
``pdserve down`` on a cluster left behind (real processes, each test well under a second or two).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from launcher.ports import HeldPort, PortInUse, PortSpec, bind_failure
from launcher.processes import child_env, die_with_parent, marked_pids
from launcher.reaper import Reaper, reap
from launcher.state import ClusterState, process_start_time, read_states, write_state

REPO = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still alive (not zombies) after waiting up to ``timeout_s`` for them to go."""
    deadline = time.monotonic() + timeout_s
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat.rsplit(b")", 1)[1].split()[0] != b"Z"


# ------------------------------------------------------------------------------------- ports


def test_a_busy_port_is_one_line_naming_it_and_its_flag() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(PortInUse) as exc:
            HeldPort("127.0.0.1", PortSpec("router HTTP", "--port", port))
    message = str(exc.value)
    assert "\n" not in message and f"port {port}" in message and "--port" in message


def test_a_held_port_is_free_for_the_server_it_is_held_for() -> None:
    held = HeldPort("127.0.0.1", PortSpec("router gRPC", "--grpc-port", 0))
    try:
        with socket.socket() as server:  # what uvicorn and gRPC do: SO_REUSEADDR, bind, listen
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", held.port))
            server.listen(1)
            socket.create_connection(("127.0.0.1", held.port), timeout=5).close()
        with socket.socket() as other, pytest.raises(OSError):  # nobody else gets it
            other.bind(("127.0.0.1", held.port))
    finally:
        held.release()


def test_bind_failures_are_recognised_in_a_log() -> None:
    grpc = "RuntimeError: Failed to bind to address 127.0.0.1:50051; set GRPC_VERBOSITY=debug"
    assert bind_failure(grpc) == 50051
    assert bind_failure("OSError: [Errno 98] Address already in use") == 0
    assert bind_failure("ValueError: unknown model") is None


# ------------------------------------------------------------------ children die with parent

PARENT = """
import subprocess, sys, time
from launcher.processes import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         preexec_fn=die_with_parent(), start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_a_child_dies_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert _alive(child)
        parent.kill()  # SIGKILL: no handler, no cleanup of its own
        parent.wait()
        assert _wait_gone([child]) == []
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


# The preexec made in this process, run in a grandchild: as if this process (its parent when
# the preexec was made) had died between fork and prctl.
ORPHANED = """
import os, signal
from launcher.processes import die_with_parent
preexec = die_with_parent()
if os.fork() == 0:
    if os.fork() == 0:
        preexec()
        os._exit(0)
    _, status = os.wait()
    os._exit(100 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
_, status = os.wait()
print(os.WEXITSTATUS(status))
"""


def test_a_child_whose_parent_died_before_prctl_kills_itself() -> None:
    done = subprocess.run(
        [sys.executable, "-c", ORPHANED], cwd=REPO, env=_env(), capture_output=True, text=True
    )
    assert done.stdout.split() == [str(100 + signal.SIGKILL)], done.stderr
    assert die_with_parent() is not None  # Linux: prctl is there


# ------------------------------------------------------------------- reaper, state, down

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


def _left_cluster(tmp_path: Path, up_pid: int) -> tuple[ClusterState, list[subprocess.Popen]]:
    """What a dead `up` leaves: marked processes, its directory, its state file."""
    marker = uuid.uuid4().hex
    workdir = tmp_path / f"pdserve-{up_pid}-left"
    (workdir / "kv").mkdir(parents=True)
    procs = [
        subprocess.Popen(SLEEPER, env=child_env(marker), start_new_session=True) for _ in range(2)
    ]
    state = ClusterState(up_pid, -1, marker, str(workdir), "", [p.pid for p in procs])
    write_state(tmp_path / "state", state)
    return state, procs


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_reaper_cleans_up_after_a_dead_up(tmp_path: Path) -> None:
    state, procs = _left_cluster(tmp_path, _dead_pid())
    state_file = tmp_path / "state" / f"{state.up_pid}.json"
    try:
        line = reap(state.marker, Path(state.workdir), state_file, grace_s=0.2)
        assert "killed 2 process(es)" in line
        assert [p.wait(timeout=10) for p in procs] == [-signal.SIGKILL] * 2
        assert not Path(state.workdir).exists() and not state_file.exists()
    finally:
        for p in procs:
            p.kill()


def test_a_dismissed_reaper_exits_and_touches_nothing(tmp_path: Path) -> None:
    state, procs = _left_cluster(tmp_path, _dead_pid())
    state_file = tmp_path / "state" / f"{state.up_pid}.json"
    try:
        reaper = Reaper(state.marker, Path(state.workdir), state_file)
        reaper.dismiss()
        assert reaper.proc.returncode == 0
        assert sorted(marked_pids(state.marker)) == sorted(p.pid for p in procs)
        assert Path(state.workdir).exists() and state_file.exists()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_state_files_name_up_by_pid_and_start_time(tmp_path: Path) -> None:
    me = ClusterState(os.getpid(), process_start_time(os.getpid()), "m", "/nowhere")
    recycled = ClusterState(os.getpid(), -1, "m", "/nowhere")  # same pid, another process
    assert me.up_alive() and not recycled.up_alive()
    exited = subprocess.Popen(["true"])  # not reaped yet: a zombie has ended all the same
    deadline = time.monotonic() + 10
    while _alive(exited.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert Path(f"/proc/{exited.pid}").exists() and process_start_time(exited.pid) is None
    exited.wait()
    write_state(tmp_path, me)
    assert [s for _, s in read_states(tmp_path)] == [me]
    (tmp_path / "junk.json").write_text("{not json")
    assert len(read_states(tmp_path)) == 1


def test_pdserve_down_stops_a_left_cluster(tmp_path: Path) -> None:
    state, procs = _left_cluster(tmp_path, _dead_pid())
    outside = tmp_path / "not-ours"  # a state file never makes `down` remove another directory
    outside.mkdir()
    other = ClusterState(_dead_pid(), -1, uuid.uuid4().hex, str(outside))
    write_state(tmp_path / "state", other)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pdserve_cli", "down", "--state-dir", str(tmp_path / "state")],
            cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"cluster of up pid {state.up_pid} (up was gone), killed 2" in done.stdout
        assert [p.wait(timeout=10) for p in procs] == [-signal.SIGKILL] * 2
        assert not Path(state.workdir).exists() and outside.exists()
        assert list((tmp_path / "state").iterdir()) == []
    finally:
        for p in procs:
            p.kill()
    again = subprocess.run(
        [sys.executable, "-m", "pdserve_cli", "down", "--state-dir", str(tmp_path / "state")],
        cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "no cluster recorded" in again.stdout


def test_pdserve_down_leaves_running_clusters_alone(tmp_path: Path) -> None:
    """Two clusters: one whose `up` is gone, one whose `up` runs (this test's process stands
    in for it). Plain `down` stops the orphan only; `--pid` names the running one."""
    orphan, procs = _left_cluster(tmp_path, _dead_pid())
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    me = os.getpid()
    live = ClusterState(me, process_start_time(me), uuid.uuid4().hex, str(live_dir))
    write_state(tmp_path / "state", live)
    down = [sys.executable, "-m", "pdserve_cli", "down", "--state-dir", str(tmp_path / "state")]
    try:
        done = subprocess.run(
            down, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert f"cluster of up pid {orphan.up_pid} (up was gone)" in done.stdout
        assert f"cluster of up pid {me} is running: left alone" in done.stdout
        assert [p.wait(timeout=10) for p in procs] == [-signal.SIGKILL] * 2
        assert [s.up_pid for _, s in read_states(tmp_path / "state")] == [me]
    finally:
        for p in procs:
            p.kill()
    usage = subprocess.run(
        [*down, "--all", "--pid", "1"], cwd=REPO, env=_env(), capture_output=True, text=True
    )
    assert usage.returncode == 2 and "not allowed with" in usage.stderr


def test_state_json_is_plain(tmp_path: Path) -> None:
    path = write_state(tmp_path, ClusterState(1, 2, "m", "/w", "http://x", [3]))
    assert json.loads(path.read_text())["process_groups"] == [3]
