"""benchmarks/speculative.py runs end to end; on the bigram workload prompt lookup is right."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bigram_workload_accepts_and_matches(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-m", "benchmarks.speculative", "--bigram", "--batch", "1",
               "--max-tokens", "48", "--runs", "1", "--json", str(out)]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    # identical tokens in both modes are asserted by the script itself
    assert rows["ngram"]["acceptance"] > 0.5
    assert rows["ngram"]["steps"] < rows["plain"]["steps"]
