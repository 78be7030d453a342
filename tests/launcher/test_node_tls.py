"""TLS between the router and its nodes on a live ``pdserve up`` (real processes, loopback):
nodes serve mutual TLS (``--tls-cert/--tls-key/--tls-client-ca``), the router verifies them for
a name rather than the address they advertise (``--node-tls-server-name``, what containers need:
their addresses are in no certificate) and presents its client certificate. Requests are served
with the offline engine's tokens; a plaintext or certificate-less caller gets nothing from a
node, and ``pdserve health`` and ``up``'s node watchdog probe it over TLS."""

from __future__ import annotations

import re
import shlex
import signal
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.chaos import MAX_TOKENS, PROMPTS, expected_texts
from launcher.health_check import check_grpc
from router.node_clients import NodeTLS
from tests.launcher.cluster_harness import UpProcess
from tests.router.test_grpc_api import _write_pki

pytestmark = pytest.mark.slow


def test_router_and_nodes_speak_mutual_tls(tmp_path: Path) -> None:
    pki = _write_pki(tmp_path)
    node_args = ["--tls-cert", pki["server"], "--tls-key", pki["server-key"],
                 "--tls-client-ca", pki["ca"]]  # fmt: skip
    router_args = ["--node-tls-ca", pki["ca"], "--node-tls-cert", pki["client"],
                   "--node-tls-key", pki["client-key"], "--node-tls-server-name", "localhost"]  # fmt: skip
    up = UpProcess(tmp_path / "logs", "--node-args", shlex.join(map(str, node_args)),
                   "--router-args", shlex.join(map(str, router_args)),
                   "--node-watchdog", "3")  # fmt: skip
    try:
        url = up.wait_ready()
        expected = expected_texts()[:3]
        with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
            for prompt, text in zip(PROMPTS, expected):
                body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS,
                        "temperature": 0.0, "ignore_eos": True}  # fmt: skip
                reply = client.post("/v1/completions", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["choices"][0]["text"] == text
        log = next(up.log_dir.glob("decode-*.log")).read_text()
        match = re.search(r"node serving on (\S+:\d+)", log)
        assert match is not None, log
        node = match.group(1)
        mutual = NodeTLS.from_files(str(pki["ca"]), str(pki["client"]), str(pki["client-key"]),
                                    "localhost")  # fmt: skip
        assert check_grpc(node, "", 10.0, mutual) == (True, "SERVING")
        no_cert = NodeTLS.from_files(str(pki["ca"]), server_name="localhost")
        assert check_grpc(node, "", 5.0, no_cert)[0] is False  # mutual TLS: a client cert first
        assert check_grpc(node, "", 5.0)[0] is False  # plaintext
        time.sleep(6.0)  # up's node watchdog probes over TLS too: no node found silent, killed
        assert check_grpc(node, "", 10.0, mutual) == (True, "SERVING")
        assert "hung" not in up.output, up.output
    except BaseException:
        print(up.output, up.logs(), sep="\n")
        up.kill()
        raise
    assert up.stop(signal.SIGINT) == 0, up.output
    assert up.leftovers() == [], up.output
