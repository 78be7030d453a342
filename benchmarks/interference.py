"""Prefill/decode interference: colocated vs disaggregated under the same offered load.

Steady Poisson traffic of short chats plus periodic bursts of long prompts. Colocated: one
engine-core process on both cores does everything (long prefills are chunked into the same
steps as running decodes). Disaggregated: a prefill engine on core 0 and a decode engine on
core 1, KV handed over through a FileStore, exactly the router's flow without the gRPC hops
(``docs/BENCHMARKS.md`` has the node-hop overhead separately). Both runs see the same arrival
schedule, prompts and seeds; latencies are measured at the client.

    python -m benchmarks.interference --out docs/benchmarks/interference
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from tqdm import tqdm

from bench.load import arrival_offsets
from bench.slo import RequestRecord, SLOConfig, SLOReport, parse_slo, summarize
from common.config import EngineConfig
from common.core_client import CoreClient
from common.sampling_params import SamplingParams
from kv_transfer.connector import create_store_connector


@dataclass(frozen=True)
class Job:
    send_s: float
    prompt: list[int]
    max_tokens: int
    seed: int


def workload(args: argparse.Namespace) -> list[Job]:
    """Poisson short requests, plus ``burst_size`` long prompts every ``burst_every_s``."""
    rng = np.random.default_rng(args.seed)
    sends = arrival_offsets(args.num_requests, args.rate, 1.0, rng)
    jobs = [
        Job(
            float(t),
            rng.integers(3, 1000, int(rng.integers(*args.short_input))).tolist(),
            int(rng.integers(*args.short_output)),
            i,
        )
        for i, t in enumerate(sends)
    ]
    t, i = args.burst_every_s / 2, len(jobs)
    while t < sends[-1]:
        for _ in range(args.burst_size):
            prompt = rng.integers(3, 1000, args.long_input).tolist()
            jobs.append(Job(t, prompt, args.long_output, i))
            i += 1
        t += args.burst_every_s
    return sorted(jobs, key=lambda j: j.send_s)


class Setup:
    """Colocated (one engine) or disaggregated (prefill engine → store → decode engine)."""

    def __init__(self, disaggregated: bool, store_url: str, model: str, batched_tokens: int):
        common = dict(model=model, max_num_batched_tokens=batched_tokens)
        self.disaggregated = disaggregated
        if disaggregated:
            self.prefill = CoreClient(
                EngineConfig.from_kwargs(
                    **common, cpu_threads=1, kv_store=store_url, kv_role="both"
                ),
                connector_factory=create_store_connector,
            )
            self.decode = CoreClient(
                EngineConfig.from_kwargs(
                    **common, cpu_threads=1, kv_store=store_url, kv_role="consumer"
                ),
                connector_factory=create_store_connector,
            )
            self.clients = [self.prefill, self.decode]
        else:
            self.decode = CoreClient(EngineConfig.from_kwargs(**common, cpu_threads=2))
            self.clients = [self.decode]

    async def start(self) -> None:
        await asyncio.gather(*(c.start() for c in self.clients))
        cores = [{0}, {1}] if self.disaggregated else [{0, 1}]
        for client, cpus in zip(self.clients, cores):
            pid = client.info.pid if client.info else None
            if pid and hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() >= 2:
                os.sched_setaffinity(pid, cpus)

    async def stop(self) -> None:
        await asyncio.gather(*(c.shutdown() for c in self.clients))

    async def run(self, job: Job, rid: str, t0: float) -> RequestRecord:
        params = SamplingParams(
            temperature=0.8, seed=job.seed, max_tokens=job.max_tokens, ignore_eos=True
        )
        start = time.perf_counter()
        times: list[float] = []
        outputs: list[int] = []
        if self.disaggregated:
            first = SamplingParams(**{**params.__dict__, "max_tokens": 1})
            async for out in self.prefill.add_request(rid, job.prompt, first):
                outputs += out.output.new_token_ids
            times.append(time.perf_counter())
        if not outputs or len(outputs) < job.max_tokens:
            async for out in self.decode.add_request(
                rid, job.prompt, params, output_token_ids=outputs or None
            ):
                now = time.perf_counter()
                times += [now] * len(out.output.new_token_ids)
                outputs += out.output.new_token_ids
        return RequestRecord(
            start - t0,
            times[0] - t0,
            [t - t0 for t in times],
            times[-1] - t0,
            len(job.prompt),
            len(outputs),
            True,
            None,
        )


async def drive(setup: Setup, jobs: list[Job], label: str) -> tuple[list[RequestRecord], float]:
    await setup.start()
    bar = tqdm(total=len(jobs), desc=label)
    t0 = time.perf_counter()

    async def one(i: int, job: Job) -> RequestRecord:
        await asyncio.sleep(max(0.0, job.send_s - (time.perf_counter() - t0)))
        record = await setup.run(job, f"{label}-{i}", t0)
        bar.update(1)
        return record

    records = await asyncio.gather(*(one(i, j) for i, j in enumerate(jobs)))
    duration = time.perf_counter() - t0
    bar.close()
    await setup.stop()
    return list(records), duration


def plot(results: dict[str, tuple[list[RequestRecord], SLOReport]], out: Path) -> None:
    fig = Figure(figsize=(13, 4.2), layout="constrained")
    ax_itl, ax_ttft, ax_time = fig.subplots(1, 3)
    for name, (records, _) in results.items():
        itl = np.sort([g * 1e3 for r in records for g in np.diff(r.token_times_s)])
        ttft = np.sort([(r.first_token_s - r.start_s) * 1e3 for r in records])
        ax_itl.step(itl, np.arange(1, itl.size + 1) / itl.size, where="post", label=name)
        ax_ttft.step(ttft, np.arange(1, ttft.size + 1) / ttft.size, where="post", label=name)
        t = [tt for r in records for tt in r.token_times_s[1:]]
        g = [gg * 1e3 for r in records for gg in np.diff(r.token_times_s)]
        ax_time.scatter(t, g, s=2, alpha=0.4, label=name)
    ax_itl.set(
        title="ITL CDF", xlabel="inter-token latency (ms)", ylabel="fraction of gaps", xscale="log"
    )
    ax_ttft.set(
        title="TTFT CDF",
        xlabel="time to first token (ms)",
        ylabel="fraction of requests",
        xscale="log",
    )
    ax_time.set(
        title="ITL over the run\n(long-prompt bursts show as spikes)",
        xlabel="time (s)",
        ylabel="ITL (ms)",
        yscale="log",
    )
    for ax in (ax_itl, ax_ttft, ax_time):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(out / "interference.png", dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=4.0, help="short requests per second")
    p.add_argument("--short-input", type=int, nargs=2, default=(32, 128))
    p.add_argument("--short-output", type=int, nargs=2, default=(48, 96))
    p.add_argument("--long-input", type=int, default=2048)
    p.add_argument("--long-output", type=int, default=8)
    p.add_argument("--burst-size", type=int, default=4)
    p.add_argument("--burst-every-s", type=float, default=6.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--slo", default="ttft=1000,tpot=60")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/interference")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = workload(args)
    slo = parse_slo(args.slo)
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        # The load generator stands in for the router: it lives with the prefill side (core 0)
        # in both setups, so the decode core of the disaggregated run is the decode engine's.
        os.sched_setaffinity(0, {0})
    results = {}
    for name in ("colocated", "disaggregated"):
        with tempfile.TemporaryDirectory(
            dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        ) as d:
            setup = Setup(
                name == "disaggregated", f"file://{d}", args.model, args.max_num_batched_tokens
            )
            records, duration = asyncio.run(drive(setup, jobs, name))
        results[name] = (records, summarize(records, duration, slo))
    report = summary(results, slo)
    (out / "interference.json").write_text(json.dumps(report | {"args": vars(args)}, indent=2))
    plot(results, out)
    print(json.dumps(report, indent=2))


def summary(results: dict[str, tuple[list[RequestRecord], SLOReport]], slo: SLOConfig) -> dict:
    rows = {}
    for name, (_, rep) in results.items():
        rows[name] = {
            "itl_p99_ms": rep.itl.p99_ms if rep.itl else None,
            "ttft_p90_ms": rep.ttft.p90_ms if rep.ttft else None,
            "goodput_rps": rep.goodput,
            "attainment": rep.overall_attainment,
        }
    c, d = rows["colocated"], rows["disaggregated"]
    ratios = {
        k: (d[k] / c[k] if c[k] else None) for k in ("itl_p99_ms", "ttft_p90_ms", "goodput_rps")
    }
    return {"slo": slo.bounds(), "results": rows, "disaggregated_over_colocated": ratios}


if __name__ == "__main__":
    main()
