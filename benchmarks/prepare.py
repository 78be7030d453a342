"""Host CPU time of one step's input preparation (``InputBuffers.prepare``) in a steady decode.

The real scheduler and KV cache manager run ``num_seqs`` requests whose prompts are ``context``
tokens (staggered by up to a block, so that each step appends at most one block per row and
about ``num_seqs / block_size`` blocks in all); once every prompt is computed, each decode step
is scheduled, prepared and given a fake token. The figure is the median over ``--steps`` steps
of the thread's CPU time (``time.thread_time_ns``) inside ``prepare``: what the engine thread
spends there; "quiet" is the lowest median of 8 consecutive steps (on a loaded VM stolen time
counts as the thread's, and other processes only ever add it). Eager layout (no graph padding), CPU buffers (on
CUDA the host half is the same work, plus two copies it only starts).

    python -m benchmarks.prepare
    python -m benchmarks.prepare --shapes 256x4096 --steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator

import torch

from common.config import SchedulerConfig
from common.kv_cache_manager import KVCacheManager
from common.request import Request
from common.sampling_params import SamplingParams
from common.scheduler import Scheduler
from common.step_inputs import BatchLimits, InputBuffers
from common.step_outputs import SampledToken, SchedulerOutput

SHAPES = ((64, 512), (256, 1024), (256, 4096), (256, 8192))  # (sequences, context tokens)
BLOCK_SIZE = 16
BUDGET = 8192  # max_num_batched_tokens


class SteadyDecode:
    """A scheduler whose ``num_seqs`` requests have computed their prompts (``context - i %
    block_size`` tokens for request ``i``) and decode from here on; ``steps()`` yields each
    decode step's plan and applies a fake token after it."""

    def __init__(self, num_seqs: int, context: int, max_tokens: int) -> None:
        self.max_model_len = context + max_tokens
        blocks = num_seqs * (-(-self.max_model_len // BLOCK_SIZE))
        cfg = SchedulerConfig(max_num_batched_tokens=BUDGET, max_num_seqs=num_seqs)
        kv = KVCacheManager(blocks, BLOCK_SIZE, enable_prefix_caching=False)
        self.scheduler = Scheduler(cfg, kv, self.max_model_len)
        for i in range(num_seqs):
            prompt = [(i * 7 + j) % 30000 + 1 for j in range(context - i % BLOCK_SIZE)]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            self.scheduler.add_request(
                Request(
                    f"r{i}",
                    prompt,
                    params,
                    eos_token_id=None,
                    block_size=BLOCK_SIZE,
                    seed=0,
                    max_tokens=max_tokens,
                )
            )
        while self._prefilling():
            self._finish(self.scheduler.schedule())

    def _prefilling(self) -> bool:
        s = self.scheduler
        return bool(s.waiting) or any(r.num_output_tokens == 0 for r in s.running)

    def _finish(self, out: SchedulerOutput) -> None:
        sampled = {s.request.request_id: SampledToken(11) for s in out.scheduled if s.samples}
        self.scheduler.update_from_output(out, sampled)

    def steps(self, count: int) -> Iterator[SchedulerOutput]:
        for _ in range(count):
            out = self.scheduler.schedule()
            yield out
            self._finish(out)


def buffers_for(num_seqs: int, max_model_len: int) -> InputBuffers:
    limits = BatchLimits(
        max_tokens=max(BUDGET, num_seqs),
        max_seqs=num_seqs,
        max_blocks_per_seq=-(-max_model_len // BLOCK_SIZE),
    )
    return InputBuffers(limits, BLOCK_SIZE, torch.device("cpu"))


def prepare_cpu_us(num_seqs: int, context: int, steps: int, warmup: int = 4) -> list[float]:
    """CPU microseconds of ``prepare`` in each of ``steps`` steady decode steps."""
    # the first requests decode while the last prompts are computed (decodes share the budget)
    prefill_steps = 2 * (-(-num_seqs * context // BUDGET)) + 8
    run = SteadyDecode(num_seqs, context, max_tokens=prefill_steps + warmup + steps)
    buffers = buffers_for(num_seqs, run.max_model_len)
    times: list[float] = []
    for i, out in enumerate(run.steps(warmup + steps)):
        assert len(out.scheduled) == num_seqs, "not a steady decode"
        assert all(s.num_new_tokens == 1 for s in out.scheduled), "not a steady decode"
        start = time.thread_time_ns()
        buffers.prepare(out.scheduled, {})
        elapsed = time.thread_time_ns() - start
        if i >= warmup:
            times.append(elapsed / 1e3)
    return times


def quiet_median(times: list[float], window: int = 8) -> float:
    """The lowest median of ``window`` consecutive steps: on a shared box (a VM's stolen time
    counts as the thread's CPU time) other processes only ever add time, in bursts."""
    return min(statistics.median(times[i : i + window]) for i in range(0, len(times), window))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=[f"{s}x{c}" for s, c in SHAPES])
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    print(f"{'sequences':>9} {'context':>8} {'median ms':>10} {'p90 ms':>8} {'quiet ms':>9}")
    for shape in args.shapes:
        num_seqs, context = (int(x) for x in shape.split("x"))
        times = prepare_cpu_us(num_seqs, context, args.steps)
        ordered = sorted(times)
        p90 = ordered[int(0.9 * (len(ordered) - 1))] / 1e3
        median, quiet = statistics.median(times) / 1e3, quiet_median(times) / 1e3
        print(f"{num_seqs:>9} {context:>8} {median:>10.3f} {p90:>8.3f} {quiet:>9.3f}")


if __name__ == "__main__":
    main()
