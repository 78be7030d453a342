"""Test helpers: real node processes, a fake router, and gRPC client calls.

A :class:`NodeProcess` runs ``python -m pdserve_cli prefill|decode --port 0 …`` from the repo
root, waits for its ``PDSERVE_READY port=N`` line, and stops it with SIGTERM (then SIGKILL).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import sampling_params_to_proto

from common.sampling_params import SamplingParams
from node_frontend.server import READY_LINE

REPO = Path(__file__).resolve().parents[2]
READY_PREFIX = READY_LINE.split("{")[0]
START_TIMEOUT_S = 240.0  # a cold start on a loaded 2-core machine is slow

# Light engines: small cache and batch, one torch thread per process.
ENGINE_FLAGS = (
    "--num-blocks", "512", "--max-model-len", "512", "--max-num-batched-tokens", "32",
    "--cpu-threads", "1",
)  # fmt: skip


class NodeProcess:
    """One node (frontend + engine core). Call :meth:`wait_ready` after construction."""

    def __init__(self, kind: str, kv_store: str, workdir: Path, *extra: str) -> None:
        self.kind = kind
        self.log_path = workdir / f"{kind}-{os.getpid()}-{time.monotonic_ns()}.log"
        cmd = [sys.executable, "-m", "pdserve_cli", kind, "--port", "0", "--kv-store", kv_store]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [*cmd, *ENGINE_FLAGS, *extra],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self.port: int | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_stdout, daemon=True).start()

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(READY_PREFIX) and self.port is None:
                self.port = int(line.split("port=")[1])
                self._ready.set()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> NodeProcess:
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.kind} node did not start:\n{self.log_tail()}")
        return self

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 120.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        self.terminate()
        code = self.wait()
        self._log.close()
        return code


def start_nodes(specs: Iterable[tuple[str, str, Path, tuple[str, ...]]]) -> list[NodeProcess]:
    """Start several nodes at once and wait for all (so their start-ups overlap)."""
    nodes = [NodeProcess(kind, store, workdir, *extra) for kind, store, workdir, extra in specs]
    try:
        for node in nodes:
            node.wait_ready()
    except BaseException:
        for node in nodes:
            node.kill()
        raise
    return nodes


@dataclass
class Pair:
    """A prefill node and a decode node sharing one KV store."""

    prefill: NodeProcess
    decode: NodeProcess
    store_url: str


class Reference:
    """The offline, colocated engine (``common.LLM``) with the nodes' engine settings."""

    def __init__(self) -> None:
        from common import LLM

        flags = dict(zip(ENGINE_FLAGS[::2], ENGINE_FLAGS[1::2]))
        self.llm = LLM(
            model="tiny-llama",
            num_blocks=int(flags["--num-blocks"]),
            max_model_len=int(flags["--max-model-len"]),
            max_num_batched_tokens=int(flags["--max-num-batched-tokens"]),
        )

    def generate(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[tuple[list[int], str | None]]:
        """(tokens, finish_reason) of each prompt."""
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        self.llm.check_integrity()
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outputs]


FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


def random_prompts(lengths: Iterable[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1000) for _ in range(n)] for n in lengths]


# -- client calls (grpc.aio, one event loop per test) ------------------------------------------


@dataclass
class Flow:
    """What one prompt → Prefill → Decode run gave back."""

    prefill: pb.PrefillResponse
    decode: list[pb.DecodeResponse] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [self.prefill.first_token_id] + [t for m in self.decode for t in m.token_ids]

    @property
    def finish_reason(self) -> int:
        return self.decode[-1].finish_reason if self.decode else self.prefill.finish_reason


class Clients:
    """Stubs of one pair on channels of the running event loop."""

    def __init__(self, pair: Pair) -> None:
        self.channels = [
            grpc.aio.insecure_channel(pair.prefill.address),
            grpc.aio.insecure_channel(pair.decode.address),
        ]
        self.prefill = pb_grpc.PrefillServiceStub(self.channels[0])
        self.decode = pb_grpc.DecodeServiceStub(self.channels[1])

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def flow(
        self, request_id: str, prompt: list[int], params: pb.SamplingParams, timeout_s=120.0
    ) -> Flow:
        """Prefill, then Decode with the handle (unless the first token already finished)."""
        request = pb.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling_params=params
        )
        flow = Flow(await self.prefill.Prefill(request, timeout=timeout_s))
        if flow.prefill.finish_reason != pb.FINISH_REASON_HANDED_OFF:
            return flow
        decode = pb.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            output_token_ids=[flow.prefill.first_token_id],
            kv_handle=flow.prefill.kv_handle,
            sampling_params=params,
        )
        async for msg in self.decode.Decode(decode, timeout=timeout_s):
            flow.decode.append(msg)
        return flow

    async def loads(self) -> tuple[pb.LoadReport, pb.LoadReport]:
        empty = pb.GetLoadRequest()
        return await self.prefill.GetLoad(empty), await self.decode.GetLoad(empty)


async def wait_all_free(clients: Clients, timeout_s: float = 60.0) -> None:
    """Poll both nodes until nothing runs or waits and every KV block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        reports = await clients.loads()
        if all(_idle(r) for r in reports):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held after {timeout_s} s: {reports}")
        await asyncio.sleep(0.1)


def _idle(report: pb.LoadReport) -> bool:
    return (
        report.num_running == 0
        and report.num_waiting == 0
        and report.num_free_blocks == report.num_total_blocks > 0
    )


def run(coro_fn: Callable[[Clients], object], pair: Pair) -> object:
    """Run ``await coro_fn(clients)`` in a fresh event loop with clients of ``pair``."""

    async def main() -> object:
        clients = Clients(pair)
        try:
            return await coro_fn(clients)  # type: ignore[misc]
        finally:
            await clients.close()

    return asyncio.run(main())


# -- a fake router ---------------------------------------------------------------------------


class FakeRouter(pb_grpc.RouterServiceServicer):
    """Records Register / Heartbeat / Deregister; ``known`` decides Heartbeat replies."""

    def __init__(self, heartbeat_interval_s: float = 0.2) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.known = True
        self.events: list[tuple[str, str, object]] = []  # (rpc, instance_id, request)
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None
        self.port = 0

    def Register(self, request, context):
        self._record("register", request.instance_id, request)
        return pb.RegisterResponse(heartbeat_interval_s=self.heartbeat_interval_s)

    def Heartbeat(self, request, context):
        self._record("heartbeat", request.instance_id, request)
        return pb.HeartbeatResponse(known=self.known)

    def Deregister(self, request, context):
        self._record("deregister", request.instance_id, request)
        return pb.DeregisterResponse(known=True)

    def _record(self, rpc: str, instance_id: str, request: object) -> None:
        with self._lock:
            self.events.append((rpc, instance_id, request))

    def count(self, rpc: str, instance_prefix: str = "") -> int:
        """Calls of ``rpc`` from instances whose id starts with ``instance_prefix``
        (``role_prefill`` / ``role_decode``)."""
        with self._lock:
            return sum(1 for e in self.events if e[0] == rpc and e[1].startswith(instance_prefix))

    def last(self, rpc: str, instance_prefix: str = "") -> object:
        with self._lock:
            hits = [e[2] for e in self.events if e[0] == rpc and e[1].startswith(instance_prefix)]
        return hits[-1] if hits else None

    def start(self, port: int = 0) -> FakeRouter:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RouterServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port(f"127.0.0.1:{port}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait()
            self._server = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.05)


# -- shared checks ---------------------------------------------------------------------------


def equivalence_cases(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Prompts that end inside a block, on a block boundary and after several blocks; each
    greedy and with seeded sampling."""
    cases = []
    for i, prompt in enumerate(random_prompts((7, 16, 33, 50), seed)):
        cases.append((prompt, SamplingParams(temperature=0.0, max_tokens=12)))
        sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed + i, max_tokens=12)
        cases.append((prompt, sampled))
    return cases


def check_equivalence(pair: Pair, reference: Reference, seed: int, concurrency: int) -> None:
    """Prompt → Prefill → Decode gives exactly the offline engine's tokens, with the prompt's
    KV coming from the store (or the decode node's own prefix cache), never recomputed."""
    cases = equivalence_cases(seed)
    expected = reference.generate([p for p, _ in cases], [s for _, s in cases])

    async def go(clients: Clients) -> list[Flow]:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int, prompt: list[int], params: SamplingParams) -> Flow:
            async with gate:
                return await clients.flow(
                    f"eq-{seed}-{i}", prompt, sampling_params_to_proto(params)
                )

        flows = await asyncio.gather(*(one(i, p, s) for i, (p, s) in enumerate(cases)))
        await wait_all_free(clients)
        return list(flows)

    flows = run(go, pair)
    for (prompt, _), flow, (tokens, reason) in zip(cases, flows, expected):
        assert flow.tokens == tokens, (prompt, flow.tokens, tokens)
        assert flow.finish_reason == FINISH[reason]
        if flow.decode:
            kv = flow.decode[0].kv_load
            assert kv.num_recomputed_tokens == 0, kv
            assert kv.num_loaded_tokens + kv.num_local_cached_tokens == len(prompt)
    assert any(f.decode and f.decode[0].kv_load.num_loaded_tokens > 0 for f in flows)
