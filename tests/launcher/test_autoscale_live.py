"""Autoscaling on a live local cluster: ``pdserve up --autoscale`` (real router, real node
processes, FileStore), driven through the OpenAI HTTP endpoint.

1. a burst of long prompts (max_tokens=1: prefill only) queues prompt tokens → prefill 1 → 2;
2. a flood of long generations fills the decode batch → decode 1 → 2;
3. idle (a light trickle of short requests) → both pools drain back to 1;
and no request fails across any of it. Thresholds and cooldowns are small so it takes minutes:
decode nodes run 2 sequences at once, prefill nodes 64 tokens per step, and the prefill backlog
budget is 256 tokens per instance.
"""

from __future__ import annotations

import random
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.launcher.cluster_harness import UpProcess, autoscaler_targets, health, wait_until

pytestmark = pytest.mark.slow

ROUTER_ARGS = (
    "--autoscale-interval 0.5 --scale-up-cooldown 1 --scale-down-cooldown 4 "
    "--scale-down-delay 4 --queue-tokens-per-instance 256 --heartbeat-interval 0.5 "
    "--heartbeat-timeout 5"
)
NODE_ARGS = "--max-num-seqs 2 --max-num-batched-tokens 64 --num-blocks 512 --max-model-len 1024"
SCALE_TIMEOUT_S = 300.0  # a new node cold-starts in 20-60 s on a busy 2-core machine


class Traffic:
    """Requests sent from background threads; every outcome is kept for the final check."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=600.0, trust_env=False)
        self.pool = ThreadPoolExecutor(max_workers=24)
        self.results: list[tuple[int, int, int]] = []  # (status, tokens, asked)
        self._lock = threading.Lock()
        self._rng = random.Random(0)

    def send(self, prompt_len: int, max_tokens: int) -> None:
        prompt = [self._rng.randrange(4, 1000) for _ in range(prompt_len)]
        self.pool.submit(self._one, prompt, max_tokens)

    def _one(self, prompt: list[int], max_tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        try:
            reply = self.client.post("/v1/completions", json=body)
            tokens = reply.json()["usage"]["completion_tokens"] if reply.status_code == 200 else 0
            outcome = (reply.status_code, tokens, max_tokens)
        except httpx.HTTPError as exc:
            outcome = (-1, 0, max_tokens)
            print(f"request failed: {exc!r}")
        with self._lock:
            self.results.append(outcome)

    def finish(self) -> list[tuple[int, int, int]]:
        self.pool.shutdown(wait=True)
        self.client.close()
        return self.results


def test_autoscaler_adds_and_removes_instances_without_failing_requests(tmp_path: Path) -> None:
    up = UpProcess(
        tmp_path / "logs",
        "--autoscale", "--prefill-max", "2", "--decode-max", "2",
        "--router-args", ROUTER_ARGS, "--node-args", NODE_ARGS,
    )  # fmt: skip
    try:
        url = up.wait_ready()
        with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
            run_scenario(client, Traffic(url))
    except BaseException:
        print(up.output, up.logs(), sep="\n")
        up.kill()
        raise
    assert up.stop(signal.SIGTERM) == 0, up.output
    assert up.leftovers() == []


def run_scenario(client: httpx.Client, traffic: Traffic) -> None:
    assert health(client) == {"prefill": 1, "decode": 1}
    assert autoscaler_targets(client) == {"prefill": 1.0, "decode": 1.0}

    # 1. A burst of long prompts: prefill only (max_tokens=1 finishes at the first token).
    burst = threading.Event()

    def prompts() -> None:
        while not burst.is_set():
            for _ in range(8):
                traffic.send(prompt_len=700, max_tokens=1)
            burst.wait(1.0)

    feeder = threading.Thread(target=prompts, daemon=True)
    feeder.start()
    try:
        wait_until(lambda: autoscaler_targets(client)["prefill"] == 2, 120.0, "prefill target 2")
    finally:
        burst.set()
        feeder.join()
    wait_until(lambda: health(client)["prefill"] == 2, SCALE_TIMEOUT_S, "2 routable prefill")

    # 2. A flood of long generations: 10 requests on a pool that runs 2 at once.
    for _ in range(10):
        traffic.send(prompt_len=16, max_tokens=400)
    wait_until(lambda: autoscaler_targets(client)["decode"] == 2, 120.0, "decode target 2")
    wait_until(lambda: health(client)["decode"] == 2, SCALE_TIMEOUT_S, "2 routable decode")

    # 3. Idle but for a trickle: both pools go back to their minimum, requests keep working.
    polls = iter(range(10**9))

    def back_to_minimum() -> bool:
        if next(polls) % 5 == 0:  # about one short request a second
            traffic.send(prompt_len=8, max_tokens=4)
        targets = autoscaler_targets(client)
        return targets == {"prefill": 1.0, "decode": 1.0} and health(client) == {
            "prefill": 1,
            "decode": 1,
        }

    wait_until(back_to_minimum, SCALE_TIMEOUT_S, "both pools back to 1")
    results = traffic.finish()
    failed = [r for r in results if r[0] != 200 or r[1] != r[2]]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[:5]}"
    asked = [r[2] for r in results]
    assert asked.count(1) >= 8 and asked.count(400) == 10 and asked.count(4) >= 1
