"""benchmarks/kv_connector.py runs end to end on a small prompt set (every phase, both stores)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_phase_runs(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks.kv_connector", "--stores", "file", "shm",
               "--prompts", "4x128", "--repeat", "1", "--dir", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| file", "| shm"))]
    assert len(rows) == 2 and "raw limits" in done.stdout
