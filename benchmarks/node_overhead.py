"""Node overhead: what the ZeroMQ hop (frontend ↔ engine-core process) and the gRPC hop add to
each request and each token, against the same engine stepped in-process.

    python benchmarks/node_overhead.py              # ~1 min on 2 cores
    python benchmarks/node_overhead.py --quick      # a few seconds of measuring

Three ways to run the same prompts (greedy, ``--batch`` requests at a time, same engine settings,
one torch thread each, a FileStore in a temp dir with the decode node's ``consumer`` KV role):

  in-process   ``EngineCore.add_request`` + ``step()`` in this process: the baseline;
  core client  ``common.core_client.CoreClient``: + msgpack over ZeroMQ ipc to the engine-core
               process and back, routed through asyncio queues;
  decode node  a ``pdserve decode`` process called over gRPC (``Decode`` without a KV handle, so
               the prompt is computed there, like in-process): + protobuf/HTTP2 on top.

Rounds alternate between the setups so drift (other load on the machine) hits all of them.
Reported per setup: mean request latency (submit → last token), TTFT, mean inter-token gap, and
the difference to in-process = the added latency per request and per token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from pdserve_proto.convert import sampling_params_to_proto

from common.config import EngineConfig
from common.core_client import CoreClient
from common.engine import EngineCore
from common.sampling_params import SamplingParams
from kv_transfer.connector import create_store_connector

REPO = Path(__file__).resolve().parents[1]
ENGINE = dict(num_blocks=512, max_model_len=512, max_num_batched_tokens=256, cpu_threads=1)


@dataclass
class Trace:
    """Arrival times of one request's tokens (``time.perf_counter`` seconds)."""

    start: float
    token_times: list[float] = field(default_factory=list)

    def add(self, count: int) -> None:
        now = time.perf_counter()
        self.token_times += [now] * count

    @property
    def latency_ms(self) -> float:
        return (self.token_times[-1] - self.start) * 1e3

    @property
    def ttft_ms(self) -> float:
        return (self.token_times[0] - self.start) * 1e3

    @property
    def itl_ms(self) -> float:
        return float(np.mean(np.diff(self.token_times)) * 1e3)


Runner = Callable[[list[list[int]], SamplingParams], Awaitable[list[Trace]]]


def make_prompts(num: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(4, 1000, size=length).tolist() for _ in range(num)]


# -- the three setups --------------------------------------------------------------------------


def in_process_runner(engine: EngineCore) -> Runner:
    ids = iter(range(10**9))

    async def run(prompts: list[list[int]], params: SamplingParams) -> list[Trace]:
        traces: dict[str, Trace] = {}
        for prompt in prompts:
            request_id = f"ip-{next(ids)}"
            traces[request_id] = Trace(time.perf_counter())
            engine.add_request(request_id, prompt, params)
        while engine.has_unfinished():
            for out in engine.step():
                traces[out.request_id].add(len(out.new_token_ids))
        return list(traces.values())

    return run


def core_client_runner(client: CoreClient) -> Runner:
    ids = iter(range(10**9))

    async def one(prompt: list[int], params: SamplingParams) -> Trace:
        trace = Trace(time.perf_counter())
        async with client.add_request(f"cc-{next(ids)}", prompt, params) as stream:
            async for item in stream:
                trace.add(len(item.output.new_token_ids))
        return trace

    async def run(prompts: list[list[int]], params: SamplingParams) -> list[Trace]:
        return list(await asyncio.gather(*(one(p, params) for p in prompts)))

    return run


def node_runner(stub: pb_grpc.DecodeServiceStub) -> Runner:
    ids = iter(range(10**9))

    async def one(prompt: list[int], params: SamplingParams) -> Trace:
        # Decode needs one output token to resume from: use the prompt's last token and count
        # the prompt one shorter, so the engine work equals the in-process request's.
        request = pb.DecodeRequest(
            request_id=f"node-{next(ids)}",
            prompt_token_ids=prompt[:-1],
            output_token_ids=prompt[-1:],
            sampling_params=sampling_params_to_proto(
                SamplingParams(**{**params.__dict__, "max_tokens": params.max_tokens + 1})
            ),
        )
        trace = Trace(time.perf_counter())
        async for msg in stub.Decode(request, timeout=600):
            trace.add(len(msg.token_ids))
        return trace

    async def run(prompts: list[list[int]], params: SamplingParams) -> list[Trace]:
        return list(await asyncio.gather(*(one(p, params) for p in prompts)))

    return run


def start_decode_node(store_url: str) -> tuple[subprocess.Popen[str], int]:
    """A ``pdserve decode`` process on an ephemeral port; returns (process, port)."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    command = [sys.executable, "-m", "pdserve_cli", "--log-level", "WARNING", "decode"]
    proc = subprocess.Popen(
        [*command, "--port", "0", "--kv-store", store_url, *flags],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("PDSERVE_READY port="):
            return proc, int(line.split("=")[1])
    raise RuntimeError(f"decode node exited with code {proc.wait()} before it was ready")


# -- measuring -------------------------------------------------------------------------------


async def measure(
    runners: dict[str, Runner], prompts: list[list[int]], args: argparse.Namespace
) -> dict[str, list[Trace]]:
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = [prompts[i : i + args.batch] for i in range(0, len(prompts), args.batch)]
    for run in runners.values():  # warm-up: first steps, connections, caches
        await run(batches[0], params)
    traces: dict[str, list[Trace]] = {name: [] for name in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            for batch in batches:
                traces[name] += await run(batch, params)
    return traces


def report(traces: dict[str, list[Trace]]) -> str:
    base = _summary(traces["in-process"])
    lines = [
        "| setup | request latency ms (mean) | TTFT ms | inter-token ms | added / request ms"
        " | added / token ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ts in traces.items():
        s = _summary(ts)
        added_req = s[0] - base[0]
        added_tok = s[2] - base[2]
        lines.append(
            f"| {name} | {s[0]:.1f} | {s[1]:.1f} | {s[2]:.2f} | {added_req:+.1f} | {added_tok:+.2f} |"
        )
    return "\n".join(lines)


def _summary(traces: list[Trace]) -> tuple[float, float, float]:
    return (
        float(np.mean([t.latency_ms for t in traces])),
        float(np.mean([t.ttft_ms for t in traces])),
        float(np.mean([t.itl_ms for t in traces])),
    )


async def main_async(args: argparse.Namespace) -> str:
    with tempfile.TemporaryDirectory(prefix="pdserve-overhead-") as tmp:
        store_url = f"file://{tmp}"
        config = EngineConfig.from_kwargs(
            model=args.model, kv_store=store_url, kv_role="consumer", **ENGINE
        )
        node, port = start_decode_node(store_url)
        client = CoreClient(config, connector_factory=create_store_connector)
        engine = EngineCore(config, create_store_connector)
        try:
            await client.start()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                runners = {
                    "in-process": in_process_runner(engine),
                    "core client (ZeroMQ)": core_client_runner(client),
                    "decode node (gRPC + ZeroMQ)": node_runner(pb_grpc.DecodeServiceStub(channel)),
                }
                prompts = make_prompts(args.num_prompts, args.prompt_len)
                traces = await measure(runners, prompts, args)
        finally:
            await client.shutdown()
            engine.close()
            node.terminate()
            node.wait(60)
    return report(traces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="requests in flight at once")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="4 prompts, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.rounds = 4, 1
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    table = asyncio.run(main_async(args))
    print(
        f"{args.num_prompts} prompts x {args.rounds} rounds, {args.prompt_len} prompt tokens,"
        f" {args.max_tokens} output tokens, batch {args.batch}, greedy"
        f" ({time.perf_counter() - start:.0f} s)\n"
    )
    print(table)


if __name__ == "__main__":
    main()
