"""Everything a GPU must prove, in one command: run it first whenever a GPU is at hand.

    python -m benchmarks.gpu_check                       # a CUDA device: the full check, <= 9 min
    python -m benchmarks.gpu_check --out gpu_check.json  # the same, figures written as JSON
    python -m benchmarks.gpu_check --device cpu --quick  # tiny shapes on CPU: tests the script

Sections, in order (correctness first; ``gpu_check_tests.py`` and ``gpu_check_measure.py`` run
them):

  kernel tests              pytest tests/kernels on CUDA (compiled kernels, not the interpreter)
  HF equivalence (on)       pytest of greedy == HF and the overlapped loop, CUDA graphs and
                            overlap on (the CUDA defaults)
  HF equivalence (off)      the same with graphs and overlap off (``PDSERVE_TEST_EAGER=1``)
  eager == graph replay     greedy tokens of an eager, serial engine and of a graph-replaying,
                            overlapped one, and of one verifying n-gram drafts in the graphs
  prefill kernel vs SDPA    the paged prefill kernel against torch's flash attention on the same
                            shapes: equal within tolerance, and its time relative to flash
  decode step b1 / b64      ms per step and % of the HBM roofline (weights + KV read per step
                            over the device's peak bandwidth)
  mixed step                a step of batch-64 decodes + a 2k chunk against the decode step
                            plus the chunk's step alone
  profiler                  kernels per decode step and GPU-busy share (``torch.profiler``)
  sampler share             the sampler (temperature + top-p, batch 64) against the step
  host KV tier, fp8 weights, fp8 KV cache, fused MoE
                            their kernels against a plain reference (fp8 KV: decode over the
                            e4m3 cache == over it widened), and their times
  throughput vs HF          the nano-vllm workload, short form (``benchmarks/throughput.py``)
  host step                 the host's own work per decode step (benchmarks/host_step.py)
                            against the device's step at the same batch
  KV load vs recompute      a prompt's KV through the connector against its prefill
                            (``benchmarks/kv_connector.py``)

Shapes: ``--load-format dummy`` weights of Llama-3.2-1B in bf16 on CUDA; a 2-layer small model
in fp32 with ``--quick`` (forced on CPU). Every section is guarded: an error or a timeout is a
failed row, never the end of the run; a global budget (``--budget-s``) skips what no longer fits.
Each row is pass / fail against its goal, or info. Only the correctness rows decide the exit
status (0: all passed); performance rows report against their goals.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.gpu_check_measure import (
    decode_steps,
    env_section,
    environment,
    fp8_gemm,
    fp8_kv_decode,
    fused_moe_kernel,
    host_step,
    host_tier_copies,
    kv_load,
    mixed_step,
    prefill_vs_sdpa,
    profiled_step,
    release_shared,
    sampler_share,
    throughput_vs_hf,
)
from benchmarks.gpu_check_tests import eager_vs_graph, hf_graphs_off, hf_graphs_on, kernel_tests
from benchmarks.gpu_check_types import FULL, QUICK, Context, Row, Section

# (name, run, correctness, least budget it needs in s)
SECTIONS = [
    Section("environment", env_section, False, 0),
    Section("kernel tests", kernel_tests, True, 20),
    Section("HF equivalence, graphs+overlap on", hf_graphs_on, True, 20),
    Section("HF equivalence, graphs+overlap off", hf_graphs_off, True, 20),
    Section("eager == graph replay", eager_vs_graph, True, 15),
    Section("prefill kernel vs SDPA", prefill_vs_sdpa, True, 10),
    Section("decode step", decode_steps, False, 20),
    Section("mixed step", mixed_step, False, 10),
    Section("profiler", profiled_step, False, 10),
    Section("sampler share", sampler_share, False, 5),
    Section("host KV tier", host_tier_copies, False, 5),
    Section("fp8 weights", fp8_gemm, True, 5),
    Section("fp8 KV cache", fp8_kv_decode, True, 5),
    Section("fused MoE", fused_moe_kernel, True, 5),
    Section("throughput vs HF", throughput_vs_hf, False, 40),
    Section("host step", host_step, False, 10),  # after the shared engine's last use
    Section("KV load vs recompute", kv_load, False, 30),
]


class SectionTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in this (main) thread after ``seconds``."""

    def expire(signum, frame):
        raise SectionTimeout(f"over its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(section: Section, ctx: Context, index: int, total: int) -> list[Row]:
    """The section's rows; an exception or timeout becomes one failed row."""
    left = ctx.remaining()
    print(f"[{index}/{total}] {section.name} ({left:.0f} s of budget left)", flush=True)
    if left < section.min_s:
        why = f"skipped: {left:.0f} s left of the budget, needs {section.min_s:.0f} s"
        return [Row(section.name, why, "run", "skip", section.correctness)]
    start = time.monotonic()
    try:
        with time_limit(left):
            rows = section.run(ctx)
    except Exception as e:
        detail = traceback.format_exc(limit=8)
        print(detail, file=sys.stderr, flush=True)
        rows = [Row(section.name, f"error: {type(e).__name__}: {e}"[:300], "runs", "fail",
                    section.correctness, {"traceback": detail})]  # fmt: skip
    for row in rows:
        row.section = section.name
        print(f"    {row.status:<4}  {row.name}: {row.measured}", flush=True)
    print(f"    ({time.monotonic() - start:.1f} s)", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    head = ("check", "measured", "goal", "result")
    cells = [head] + [(r.name, r.measured, r.goal, r.status.upper()) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(head))]
    lines = []
    for n, cell in enumerate(cells):
        lines.append(" | ".join(text.ljust(w) for text, w in zip(cell, widths)).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", help="auto: cuda when there is one, else cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes (always on for cpu)")
    p.add_argument("--budget-s", type=float, default=540.0, help="the whole run's time budget")
    p.add_argument("--out", default=None, help="write the rows and environment here (JSON)")
    p.add_argument("--only", nargs="+", default=None, help="run only sections named so (prefix)")
    p.add_argument("--log-dir", default=None, help="write each test run's whole output here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    name = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cpu":  # the Triton kernels run in the interpreter (read at import)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    profile = QUICK if args.quick or device.type == "cpu" else FULL
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
        ctx = Context(args, device, profile, started + args.budget_s, Path(work))
        env = environment(ctx)
        print(f"gpu_check on {env['device_name']} ({env['date']}), budget {args.budget_s:.0f} s")
        chosen = [s for s in SECTIONS if not args.only or s.name.startswith(tuple(args.only))]
        rows = [r for i, s in enumerate(chosen, 1) for r in run_section(s, ctx, i, len(chosen))]
        release_shared(ctx)
    passed = all(r.status == "pass" for r in rows if r.correctness)
    print("\n" + table(rows))
    print(f"\ncorrectness: {'PASS' if passed else 'FAIL'}; {time.monotonic() - started:.0f} s")
    if args.out:
        report = {"environment": env, "profile": asdict(profile), "passed": passed}
        report["elapsed_s"] = time.monotonic() - started
        report["rows"] = [asdict(r) for r in rows]
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
