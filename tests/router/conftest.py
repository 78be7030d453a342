"""Fixtures of the router's end-to-end tests: a real router process in front of real prefill
and decode node processes on 127.0.0.1, sharing a FileStore in a temp dir.

The cluster (1 router, 2 prefill, 2 decode) is started once per session because node start-up
dominates on a small machine; tests that kill nodes (``test_faults_e2e.py``) run after the ones
that only send requests, and every test leaves the surviving nodes idle with all blocks free.
Nodes register through ``--router``; a second router with an API key reaches the same nodes as
static instances (``--prefill/--decode``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

from tests.services.nodes import ENGINE_FLAGS, NodeProcess

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
API_KEY = "test-key-123"
# Small limits so the bad-input tests stay cheap. No --max-model-len: the routers learn the
# nodes' (ENGINE_FLAGS) from their registrations / GetInfo.
ROUTER_FLAGS = (
    "--max-body-bytes", "65536", "--max-header-bytes", "8192", "--heartbeat-interval", "0.5",
    "--heartbeat-timeout", "6", "--max-n", "4", "--max-logprobs", "5",
    "--slo", "ttft=60000,tpot=60000",
)  # fmt: skip


class RouterProcess:
    """``pdserve router --port 0 --grpc-port 0 …``; ports read from its PDSERVE_READY line."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        self.log_path = workdir / f"router-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("wb")
        cmd = [sys.executable, "-m", "pdserve_cli", "router", "--port", "0", "--grpc-port", "0"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [*cmd, *extra], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=self._log, text=True
        )
        self.http_port = self.grpc_port = 0
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("PDSERVE_READY") and not self._ready.is_set():
                fields = dict(part.split("=") for part in line.split()[1:])
                self.http_port, self.grpc_port = int(fields["http_port"]), int(fields["grpc_port"])
                self._ready.set()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> RouterProcess:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"router did not start:\n{self.log_tail()}")
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


@dataclass
class Cluster:
    router: RouterProcess
    prefill: list[NodeProcess]
    decode: list[NodeProcess]
    store_url: str
    workdir: Path

    def alive(self) -> list[NodeProcess]:
        return [n for n in self.prefill + self.decode if n.proc.poll() is None]

    def wait_instances(self, prefill: int, decode: int, timeout_s: float = 120.0) -> None:
        """Until the router's /health lists exactly this many ready instances per pool."""
        wanted = {"prefill": prefill, "decode": decode}
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                health = httpx.get(f"{self.router.base_url}/health", timeout=10).json()
                if health["instances"] == wanted:
                    return
            except httpx.HTTPError:
                health = None
            if time.monotonic() > deadline:
                raise AssertionError(f"router instances {health}, wanted {wanted}")
            time.sleep(0.2)


def run_cluster(workdir: Path, prefill: int, decode: int, *node_flags: str) -> Iterator[Cluster]:
    """A router and ``prefill`` + ``decode`` registered nodes over a file store, until the
    generator is closed (a fixture's body)."""
    store_url = f"file://{workdir / 'kv'}"
    router = RouterProcess(workdir, *ROUTER_FLAGS).wait_ready()
    extra = ("--router", router.grpc_target, *node_flags)
    kinds = ["prefill"] * prefill + ["decode"] * decode
    nodes = [NodeProcess(kind, store_url, workdir, *extra) for kind in kinds]
    try:
        for node in nodes:
            node.wait_ready()
        result = Cluster(router, nodes[:prefill], nodes[prefill:], store_url, workdir)
        result.wait_instances(prefill, decode)
    except BaseException:
        for node in nodes:
            node.kill()
        router.stop()
        raise
    yield result
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.wait()
    assert router.stop() == 0, router.log_tail()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    yield from run_cluster(tmp_path_factory.mktemp("router-e2e"), 2, 2, "--max-num-seqs", "64")


@pytest.fixture(scope="session")
def keyed_router(cluster: Cluster) -> Iterator[RouterProcess]:
    """A second router with ``--api-key``, reaching the cluster's nodes as static instances."""
    prefill = ",".join(n.address for n in cluster.prefill)
    decode = ",".join(n.address for n in cluster.decode)
    router = RouterProcess(
        cluster.workdir, *ROUTER_FLAGS, "--api-key", API_KEY, "--prefill", prefill,
        "--decode", decode,
    ).wait_ready()  # fmt: skip
    yield router
    assert router.stop() == 0, router.log_tail()


@dataclass(frozen=True)
class Expected:
    token_ids: list[int]
    text: str
    finish_reason: str


@pytest.fixture(scope="session")
def offline():  # type: ignore[no-untyped-def]
    """The offline engine (``common.LLM``) with the nodes' engine settings."""
    from common import LLM

    flags = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))
    return LLM(
        model="tiny-llama",
        num_blocks=int(flags["--num-blocks"]),
        max_model_len=int(flags["--max-model-len"]),
        max_num_batched_tokens=int(flags["--max-num-batched-tokens"]),
    )


def expected(llm, prompts: list, params: list) -> list[list[Expected]]:  # type: ignore[no-untyped-def]
    """Offline outputs: per prompt, one Expected per sample."""
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.check_integrity()
    return [
        [Expected(list(s.token_ids), s.text, s.finish_reason) for s in out.outputs]
        for out in outputs
    ]


# -------------------------------------------------------------------------- node checks


async def _load(address: str, role: str) -> pb.LoadReport:
    async with grpc.aio.insecure_channel(address) as channel:
        stub_type = pb_grpc.PrefillServiceStub if role == "prefill" else pb_grpc.DecodeServiceStub
        return await stub_type(channel).GetLoad(pb.GetLoadRequest(), timeout=10)


def wait_no_leaks(cluster: Cluster, timeout_s: float = 60.0) -> None:
    """Every live node idle with ``num_free_blocks == num_total_blocks`` (GetLoad)."""

    async def loads() -> list[pb.LoadReport]:
        return [await _load(n.address, n.kind) for n in cluster.alive()]

    deadline = time.monotonic() + timeout_s
    while True:
        reports = asyncio.run(loads())
        idle = [
            r.num_running == 0 and r.num_waiting == 0 and r.num_free_blocks == r.num_total_blocks
            for r in reports
        ]
        if all(idle) and reports:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {reports}")
        time.sleep(0.2)


def node_load(node: NodeProcess) -> pb.LoadReport:
    return asyncio.run(_load(node.address, node.kind))
