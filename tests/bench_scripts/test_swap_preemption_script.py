"""benchmarks/swap_preemption.py runs end to end: both modes give the unpreempted tokens (the
script checks it), both preempt, and only recompute computes tokens twice."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_swap_recomputes_nothing_and_recompute_does(tmp_path: Path) -> None:
    out, png = tmp_path / "swap.json", tmp_path / "swap.png"
    command = [sys.executable, "-m", "benchmarks.swap_preemption", "--requests", "8",
               "--prompt-tokens", "64", "--output-tokens", "32", "--json", str(out),
               "--plot", str(png)]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["unpreempted"]["preemptions"] == 0
    assert rows["recompute"]["preemptions"] > 0 and rows["recompute"]["recomputed_tokens"] > 0
    swap = rows["swap (host tier)"]
    assert swap["preemptions"] > 0 and swap["recomputed_tokens"] == 0
    assert swap["host_tier_loaded_blocks"] > 0 and png.stat().st_size > 0
