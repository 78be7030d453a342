"""Chaos on a live ``pdserve up`` (Redis store, 1 prefill + 2 decode): 8 concurrent streams of
greedy requests checked against the offline engine while a decode node, the prefill node, the
router and Redis are SIGKILLed one at a time (driver: ``benchmarks.chaos``).

No client retry hides anything: a decode, prefill or Redis kill loses, truncates or changes no
request; a router kill fails requests only while no router listens (counted, and its restart
window bounded). After each kill the cluster is back to full strength, and SIGTERM of `up`
leaves no process.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from pathlib import Path

import httpx
import pytest

from benchmarks.chaos import (
    FAULTS,
    cluster_pids,
    expected_texts,
    ready_counts,
    run_chaos,
    stop_on_failure,
    table,
)
from tests.launcher.cluster_harness import UpProcess, wait_until

pytestmark = pytest.mark.slow

ROUTER_RESTART_MAX_S = 60.0  # a cold router start on a loaded 2-core machine, with margin


def test_one_crash_at_a_time_loses_no_request(tmp_path: Path) -> None:
    expected = expected_texts()
    up = UpProcess(tmp_path / "logs", "--kv-store", "redis", "--prefill", "1", "--decode", "2")
    try:
        url = up.wait_ready()
        rows = asyncio.run(run_chaos(up, url, expected, streams=8, settle_s=5.0))
    except BaseException:
        print(up.output, up.logs(), sep="\n")
        stop_on_failure(up)
        raise
    print(table(rows))  # shown with -s, and in the failure report
    assert up.stop(signal.SIGTERM) == 0, up.output
    assert up.leftovers() == [], up.output
    by_fault = {row.fault: row for row in rows}
    assert list(by_fault) == ["none", *FAULTS]
    for fault in ("none", "decode", "prefill", "redis"):
        row = by_fault[fault]
        assert row.requests > 0, table(rows)
        assert (row.failed, row.truncated, row.different) == (0, 0, 0), (table(rows), row)
    router = by_fault["router"]
    assert (router.truncated, router.different) == (0, 0), (table(rows), router)
    assert router.recovery_s < ROUTER_RESTART_MAX_S
    assert router.failing_s <= router.recovery_s + 5.0, table(rows)  # only while it restarts
    assert "stopping the cluster" in up.output and "nothing can serve" not in up.output


def test_a_killed_tensor_parallel_rank_loses_no_request(tmp_path: Path) -> None:
    """Decode nodes at TP 2 (gloo ranks): SIGKILL of one node's rank 1 fails its engine, the node
    stops (its streams migrate to the other decode node) and `up` replaces it; no request is
    lost or changed (the offline engine at TP 1 gives the expected text)."""
    expected = expected_texts()
    up = UpProcess(tmp_path / "logs", "--kv-store", "redis", "--prefill", "1", "--decode", "2",
                   "--decode-tp", "2")  # fmt: skip
    try:
        url = up.wait_ready()
        rows = asyncio.run(
            run_chaos(up, url, expected, streams=4, settle_s=3.0, faults=("decode-rank",))
        )
    except BaseException:
        print(up.output, up.logs(), sep="\n")
        stop_on_failure(up)
        raise
    print(table(rows))
    assert up.stop(signal.SIGTERM) == 0, up.output
    assert up.leftovers() == [], up.output
    for row in rows:
        assert row.requests > 0, table(rows)
        assert (row.failed, row.truncated, row.different) == (0, 0, 0), (table(rows), row)


def test_autoscaled_nodes_and_the_router_come_back(tmp_path: Path) -> None:
    """With ``--autoscale`` the router's actuator replaces a crashed node (`up` does not start a
    second one), and `up` restarts the router, whose actuator starts its nodes afresh."""
    up = UpProcess(tmp_path / "logs", "--autoscale", "--prefill-max", "1", "--decode-max", "2")
    full = {"prefill": 1, "decode": 1}
    try:
        url = up.wait_ready()
        for fault in ("decode", "router"):
            victim = cluster_pids(up.tag, "-")[fault][0]
            os.kill(victim, signal.SIGKILL)
            back = functools.partial(_back, url, up.tag, fault, victim, full)
            wait_until(back, 180, f"{fault} back")
        assert len(cluster_pids(up.tag, "-")["decode"]) == 1  # replaced once, not twice
        body = {"model": "tiny-llama", "prompt": "Hello", "max_tokens": 4}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60, trust_env=False)
        assert reply.status_code == 200, reply.text
    except BaseException:
        print(up.output, up.logs(), sep="\n")
        stop_on_failure(up)
        raise
    assert up.stop(signal.SIGTERM) == 0, up.output
    assert up.leftovers() == [], up.output


def _back(url: str, tag: str, fault: str, victim: int, full: dict[str, int]) -> bool:
    pids = cluster_pids(tag, "-")
    ready, counts = ready_counts(url)
    successor = any(p != victim for p in pids.get(fault, []))
    return successor and ready and counts == full and len(pids.get("decode", [])) == 1
