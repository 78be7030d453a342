"""benchmarks/lora.py runs end to end: three modes, the same step count, a plot."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_three_modes_run_and_are_reported(tmp_path: Path) -> None:
    out, png = tmp_path / "lora.json", tmp_path / "lora.png"
    command = [sys.executable, "-m", "benchmarks.lora", "--runs", "1", "--batch", "6",
               "--max-tokens", "6", "--adapters", "2", "--rank", "8", "--json", str(out),
               "--plot", str(png)]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    # the base rows of "mixed" keeping base's tokens is asserted by the script itself
    assert [r["mode"] for r in report["rows"]] == ["base", "one adapter", "mixed"]
    assert {r["steps"] for r in report["rows"]} == {6}
    assert all(r["tok_s"] > 0 for r in report["rows"]) and png.stat().st_size > 0
