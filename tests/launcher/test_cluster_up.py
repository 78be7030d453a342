"""``pdserve up`` end to end: starts a real cluster, serves, stops with nothing left running."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx
import pytest

from tests.launcher.cluster_harness import UpProcess, health

pytestmark = pytest.mark.slow


def test_up_serves_a_request_and_ctrl_c_stops_everything(tmp_path: Path) -> None:
    """With the prefill pool at tensor-parallel size 2 (two gloo ranks), decode at 1."""
    up = UpProcess(tmp_path / "logs", "--api-key", "up-test-key", "--prefill-tp", "2")
    try:
        url = up.wait_ready()
        headers = {"Authorization": "Bearer up-test-key"}
        with httpx.Client(base_url=url, headers=headers, timeout=120.0, trust_env=False) as client:
            assert health(client) == {"prefill": 1, "decode": 1}
            body = {"model": "tiny-llama", "prompt": "Hello there", "max_tokens": 8}
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["completion_tokens"] == 8
            assert (
                client.post("/v1/completions", json=body, headers={"Authorization": ""}).status_code
                == 401
            )
        pids = up.leftovers()
        assert len(pids) >= 6  # router, 2 nodes, their 2 engine cores, the prefill's rank 1
    except BaseException:
        up.kill()
        raise
    assert up.stop(signal.SIGINT) == 0, up.output
    assert up.leftovers() == [], up.output
    kv_dir = re.search(r"KV store\s+shm://([^?\s]+)", up.output)
    assert kv_dir is not None and not Path(kv_dir.group(1)).exists()  # temp store removed
    assert "did not stop" not in up.output  # every child exited on its own


def test_up_demo_with_a_private_redis(tmp_path: Path) -> None:
    up = UpProcess(tmp_path / "logs", "--demo", "--demo-requests", "6", "--kv-store", "redis",
                   "--slo", "ttft=60000,tpot=60000")  # fmt: skip
    try:
        code = up.wait_exit(timeout_s=600.0)
    except BaseException:
        up.kill()
        raise
    assert code == 0, f"{up.output}\n{up.logs()}"
    assert re.search(r"KV store\s+redis://:\*\*\*@127\.0\.0\.1:\d+/0", up.output)  # password hidden
    assert "== sample requests ==" in up.output
    assert "| TTFT |" in up.output and "| 6 | 0 |" in up.output  # 6 requests, 0 failed
    assert up.leftovers() == []


def test_up_serves_a_moe_model_disaggregated_as_colocated(tmp_path: Path) -> None:
    """``pdserve up --model tiny-qwen3-moe``: prefill node → store → decode node, the greedy
    completion equal to the offline engine's (one colocated process)."""
    from common import LLM, SamplingParams

    prompt = "Experts route each token"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    [want] = LLM(model="tiny-qwen3-moe").generate([prompt], params, use_tqdm=False)
    up = UpProcess(tmp_path / "logs", "--model", "tiny-qwen3-moe")
    try:
        url = up.wait_ready()
        with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
            assert health(client) == {"prefill": 1, "decode": 1}
            body = {"model": "tiny-qwen3-moe", "prompt": prompt, "max_tokens": 12,
                    "temperature": 0.0, "ignore_eos": True}  # fmt: skip
            reply = client.post("/v1/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == want.outputs[0].text
    except BaseException:
        up.kill()
        raise
    assert up.stop(signal.SIGINT) == 0, up.output
    assert up.leftovers() == [], up.output
