"""50 concurrent non-streaming requests abandoned mid-decode on the real cluster: within a few
seconds no node runs or queues anything, nothing starts again, and every block is free."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.router.conftest import Cluster, node_load, wait_no_leaks
from tests.router.test_abandon import open_and_abandon


def _busy(cluster: Cluster) -> int:
    loads = [node_load(node) for node in cluster.alive()]
    return sum(load.num_running + load.num_waiting for load in loads)


def _decoding(cluster: Cluster) -> int:
    return sum(node_load(node).num_running for node in cluster.decode)


@pytest.mark.parametrize("when", ["mid-decode", "mid-prefill"])
def test_fifty_abandoned_requests_stop_generating(cluster: Cluster, when: str) -> None:
    prompt = [1, *range(400, 420)] if when == "mid-decode" else [1, *range(400, 700)]
    body = json.dumps({"prompt": prompt, "max_tokens": 200, "ignore_eos": True})

    async def go() -> None:
        writers = await open_and_abandon(cluster.router.base_url, 50, body.encode())
        deadline = time.monotonic() + 120
        while when == "mid-decode" and await asyncio.to_thread(_decoding, cluster) < 20:
            assert time.monotonic() < deadline, "the requests never reached decode"
            await asyncio.sleep(0.2)
        await asyncio.sleep(0.5)  # mid-prefill: long prompts, queued on the prefill nodes
        for writer in writers:
            writer.close()

    asyncio.run(go())
    closed = time.monotonic()
    while _busy(cluster):
        assert time.monotonic() - closed < 10, "nodes still generate for abandoned requests"
        time.sleep(0.1)
    stopped = time.monotonic()
    while time.monotonic() - stopped < 2:  # and nothing comes back
        assert not _busy(cluster)
        time.sleep(0.2)
    wait_no_leaks(cluster, timeout_s=10)
