"""benchmarks/host_step.py runs, greedy and with seeded draws, and reports each batch's cost."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("temperature", ["0", "0.6"])
def test_host_step_reports_every_batch(temperature: str) -> None:
    command = [sys.executable, "-m", "benchmarks.host_step", "--batches", "1", "8", "--steps",
               "3", "--repeat", "1", "--temperature", temperature]  # fmt: skip
    run = subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=300)
    rows = [line.split() for line in run.stdout.splitlines()[-2:]]
    assert [row[0] for row in rows] == ["1", "8"]
    assert all(float(row[1]) > 0 for row in rows) and len(rows[1]) == 3  # step ms; µs per request
