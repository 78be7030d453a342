"""Restart budgets count per cause: crashes of different causes never add up into a give-up."""

from __future__ import annotations

import signal
import sys
import uuid
from pathlib import Path

from launcher.processes import ManagedProcess, child_env, marked_pids
from launcher.supervisor import RestartBudgets, RestartPolicy, exit_cause


def test_each_cause_has_its_own_budget() -> None:
    now = [0.0]
    budgets = RestartBudgets(RestartPolicy(0.5, 4.0, max_failures=3, window_s=60), lambda: now[0])
    poison, killed = "IndexError: selected index k out of range", "exit status -9"
    assert [budgets.failed(poison), budgets.failed(killed)] == [0.5, 0.5]
    assert [budgets.failed(poison), budgets.failed(killed)] == [1.0, 1.0]
    assert budgets.failed(poison) is None  # its 3rd: given up, with 4 exits in all
    assert "3 exits in 60 s of this cause: IndexError" in budgets.describe(poison)
    assert budgets.failed(killed) is None


def _exited(tmp_path: Path, marker: str, code: str) -> ManagedProcess:
    argv = [sys.executable, "-c", code]
    process = ManagedProcess("child", argv, tmp_path / f"{uuid.uuid4().hex}.log", child_env(marker))
    process.proc.wait(30)
    return process


def test_the_cause_is_the_last_error_with_numbers_blanked(tmp_path: Path) -> None:
    marker = uuid.uuid4().hex
    crash = "import sys; print('RuntimeError: bad block {} at 0x{:x}'); sys.exit(1)"
    first = _exited(tmp_path, marker, crash.replace("{}", "17").replace("{:x}", "7f01"))
    second = _exited(tmp_path, marker, crash.replace("{}", "4").replace("{:x}", "beef"))
    assert exit_cause(first) == exit_cause(second) == "RuntimeError: bad block N at N"
    quiet = _exited(tmp_path, marker, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert exit_cause(quiet) == f"exit status {-signal.SIGKILL}"
    assert marked_pids(marker) == []
