"""A damaged shm arena on a live ``pdserve up`` (issue 26, item 6; the fault campaign's repro):
the arena's first 8 bytes overwritten, the decode node SIGKILLed. Its replacement starts (it had
crash-looped on the damaged header) by putting a fresh arena in place, the prefill node moves to
that file, and every request is served with the offline engine's tokens, through the store."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import httpx
import pytest

from benchmarks.chaos import (
    MAX_TOKENS,
    PROMPTS,
    cluster_pids,
    expected_texts,
    ready_counts,
    stop_on_failure,
)
from kv_store import ArenaStore
from kv_store.arena_store import read_fingerprint
from tests.launcher.cluster_harness import UpProcess, wait_until

pytestmark = pytest.mark.slow


def _completions(url: str) -> list[str]:
    texts = []
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
        for prompt in PROMPTS:
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
    return texts


def _shared_hits(arena: Path) -> int:
    with ArenaStore(arena, read_fingerprint(arena)) as store:
        return store.stats().shared_hits


def test_a_damaged_arena_is_replaced_and_shared_again(tmp_path: Path) -> None:
    expected = expected_texts()
    up = UpProcess(tmp_path / "logs", "--kv-store", "shm", "--prefill", "1", "--decode", "1")
    try:
        url = up.wait_ready()
        kv_dir = re.search(r"KV store\s+shm://([^?\s]+)", up.output)
        assert kv_dir is not None, up.output
        assert _completions(url) == expected
        (arena,) = Path(kv_dir.group(1)).glob("*.arena")
        with open(arena, "r+b") as f:
            f.write(b"\xff" * 8)
        (victim,) = cluster_pids(up.tag, "-")["decode"]
        os.kill(victim, signal.SIGKILL)

        def back() -> bool:  # the successor registered (the router may count the dead node
            successor = up.log_dir / "decode-2.log"  # healthy until its heartbeats lapse)
            registered = successor.exists() and "registered with router" in successor.read_text()
            ready, counts = ready_counts(url)
            return registered and ready and counts == {"prefill": 1, "decode": 1}

        wait_until(back, 120, "a replacement decode node ready")
        assert _completions(url) == expected  # the engines open the store: it is replaced
        hits_before = _shared_hits(arena)  # the new file (opening it checks its header)
        assert _completions(url) == expected  # the prefill node has moved by now (1 s checks)
        assert _shared_hits(arena) > hits_before, up.logs()  # decode loads what prefill saved
        logs = "\n".join(p.read_text(errors="replace") for p in up.log_dir.glob("*.log"))
        assert "replaced by a fresh, empty arena" in logs
        assert "moved to the arena now at its path" in logs
    except BaseException:
        print(up.output, up.logs(), sep="\n")
        stop_on_failure(up)
        raise
    assert up.stop(signal.SIGTERM) == 0, up.output
    assert up.leftovers() == [], up.output
