"""benchmarks/kv_connector.py runs end to end on a small prompt set (every phase, both stores,
the model's dtype and the FP8 KV cache side by side)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two minutes: four engine sets, two stores, two cache dtypes
def test_every_phase_runs(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.kv_connector", "--stores", "file", "shm",
               "--prompts", "4x128", "--repeat", "1", "--dir", str(tmp_path),
               "--kv-cache-dtype", "auto", "fp8"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| file", "| shm"))]
    assert len(rows) == 4 and "raw limits" in done.stdout
    per_token = {row.split("|")[3].strip() for row in rows}
    assert per_token == {"auto (32768)", "fp8 (8192)"}  # the fp32 shape's bytes, a quarter
