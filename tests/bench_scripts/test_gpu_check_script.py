"""benchmarks/gpu_check.py: its guards (fast, with stand-in sections) and the whole script on
CPU in its quick mode (slow: every section, its pytest runs included)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check_types import Row, Section

REPO = Path(__file__).resolve().parents[2]


def _boom(ctx):
    raise RuntimeError("kernel exploded")


def _fine(ctx):
    return [Row.check("fine", True, "1/1", "all")]


def _slow_perf(ctx):
    return [Row.perf("slow", False, "9 ms", "<= 1 ms")]


def _sleeps(ctx):
    time.sleep(60)
    return []


def run_main(monkeypatch, tmp_path, sections, *flags: str) -> tuple[int, dict]:
    monkeypatch.setattr(gpu_check, "SECTIONS", sections)
    out = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--out", str(out), *flags])
    return code, json.loads(out.read_text())


def test_a_failing_section_is_a_failed_row_not_a_crash(monkeypatch, tmp_path, capsys):
    sections = [Section("boom", _boom, True, 0), Section("fine", _fine, True, 0)]
    code, report = run_main(monkeypatch, tmp_path, sections)
    assert code == 1 and report["passed"] is False
    boom, fine = report["rows"]
    assert boom["status"] == "fail" and "kernel exploded" in boom["measured"]
    assert fine["status"] == "pass"  # the run went on after the failure
    assert "| FAIL" in capsys.readouterr().out


def test_performance_rows_do_not_decide_the_exit_status(monkeypatch, tmp_path):
    sections = [Section("fine", _fine, True, 0), Section("slow", _slow_perf, False, 0)]
    code, report = run_main(monkeypatch, tmp_path, sections)
    assert code == 0 and [r["status"] for r in report["rows"]] == ["pass", "fail"]


def test_the_budget_skips_and_stops_sections(monkeypatch, tmp_path):
    sections = [Section("sleeps", _sleeps, False, 0), Section("needs", _fine, True, 60)]
    start = time.monotonic()
    code, report = run_main(monkeypatch, tmp_path, sections, "--budget-s", "10")
    assert time.monotonic() - start < 40
    sleeps, needs = report["rows"]
    assert sleeps["status"] == "fail" and "SectionTimeout" in sleeps["measured"]
    assert needs["status"] == "skip" and code == 1  # a correctness row not run is not a pass


@pytest.mark.slow
def test_quick_run_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--quick",
               "--budget-s", "1500", "--out", str(out)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["rows"]}
    # every section gave its rows, none crashed
    assert [s.name for s in gpu_check.SECTIONS] == list(dict.fromkeys(rows_of(report)))
    assert not [r for r in report["rows"] if r["measured"].startswith("error")]
    correctness = [r for r in report["rows"] if r["correctness"]]
    assert len(correctness) == 9 and all(r["status"] == "pass" for r in correctness)
    assert rows["kernel tests"]["values"]["tests"] > 0
    assert rows["eager == graph replay"]["measured"].startswith("4/4 prompts equal")
    assert rows["eager == graph-replayed verification"]["measured"].startswith("4/4 prompts equal")
    table = done.stdout[done.stdout.index("check ") :]
    assert all(f"| {r['status'].upper()}" in table for r in report["rows"])
    assert "correctness: PASS" in done.stdout


def rows_of(report: dict) -> list[str]:
    return [r["section"] for r in report["rows"]]
