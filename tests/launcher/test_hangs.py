"""A hung node on a live ``pdserve up`` (file store, 1 prefill + 2 decode; issue 26, item 5): one
decode node is SIGSTOPped — alive, its connections open, answering nothing — under 4 streams of
greedy requests checked against the offline engine (driver: ``benchmarks.chaos``, fault
``decode-stop``).

Its requests move to the other decode node at the router's progress timeout and finish with the
right tokens, none lost; the router marks it stalled; `up`'s watchdog kills it and a replacement
registers. Bounds are shortened (--progress-timeout 3, --node-watchdog 6) to keep the test short;
docs/DEPLOYMENT.md has the defaults' figures.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from benchmarks.chaos import expected_texts, run_on, table
from tests.launcher.cluster_harness import UpProcess

pytestmark = pytest.mark.slow

PROGRESS_TIMEOUT_S = 3.0
WATCHDOG_S = 6.0
# after the stop: the deadline, a maintenance round (2 s), then the rest of a 16-token request
MIGRATED_WITHIN_S = PROGRESS_TIMEOUT_S + 7.0
REPLACED_WITHIN_S = WATCHDOG_S + 60.0  # + a node's cold start on a loaded 2-core machine


def test_a_stopped_decode_node_loses_no_request_and_is_replaced(tmp_path: Path) -> None:
    expected = expected_texts()
    up = UpProcess(
        tmp_path / "logs", "--kv-store", "file", "--prefill", "1", "--decode", "2",
        "--node-watchdog", f"{WATCHDOG_S:g}",
        "--router-args", f"--progress-timeout {PROGRESS_TIMEOUT_S:g}",
    )  # fmt: skip
    rows = run_on(up, expected, streams=4, settle_s=3.0, faults=("decode-stop",))
    print(table(rows))  # shown with -s, and in the failure report
    router_log = (up.log_dir / "router.log").read_text(errors="replace")
    assert up.stop(signal.SIGTERM) == 0, up.output
    assert up.leftovers() == [], up.output
    baseline, stopped = rows
    assert baseline.requests > 0 and stopped.requests > 0, table(rows)
    assert (stopped.failed, stopped.truncated, stopped.different) == (0, 0, 0), table(rows)
    assert stopped.in_flight_s < MIGRATED_WITHIN_S, table(rows)
    assert stopped.recovery_s < REPLACED_WITHIN_S, table(rows)
    assert "is stalled: no engine progress" in router_log, router_log[-3000:]
    assert "is hung: no answer for" in up.output and "killing it" in up.output, up.output
