"""benchmarks/kv_tiers.py runs end to end: every tier gives recompute's first token (the script
checks it) and the host tier's hits really came from the host tier."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_tier_is_timed_and_the_host_tier_served_its_hits(tmp_path: Path) -> None:
    out, png = tmp_path / "tiers.json", tmp_path / "tiers.png"
    command = [sys.executable, "-m", "benchmarks.kv_tiers", "--prompts", "3x200", "--json",
               str(out), "--plot", str(png)]  # fmt: skip
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    report = json.loads(out.read_text())
    tiers = [row["tier"] for row in report["rows"]]
    assert tiers == ["recompute", "device", "host tier", "store (file)"]
    assert report["host_tier_loaded_blocks"] >= 3 * (199 // 16)  # every prompt's full blocks
    assert png.stat().st_size > 0
