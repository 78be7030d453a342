"""Preemption under memory pressure: swap through the host KV tier against recompute.

All requests arrive at once into a KV cache a quarter of their working set (``--cache-share``),
so the scheduler keeps preempting. Without a host tier a preempted request recomputes its
prompt and output when it resumes (its blocks stay in the prefix cache until evicted; under this
pressure most are); with one (``--kv-offload-gb``, sized for the working set) its blocks come
back from host memory. One process, one workload, greedy and seeded requests; both modes must
give the unpreempted run's tokens (checked). Reported per mode: output tokens/s, ITL p50/p99
(gaps between one request's tokens as the engine emits them), preemptions, tokens computed
more than once.

    python -m benchmarks.swap_preemption                    # tiny-llama, 32 x (256 + 128)
    python -m benchmarks.swap_preemption --requests 16 --json out.json --plot swap.png
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from benchmarks.report_io import parser, pyplot, save_figure, write_outputs
from common import LLM, SamplingParams

BLOCK = 16


def _workload(n: int, prompt: int, output: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(prompt)] for _ in range(n)]
    params = [
        SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=output, ignore_eos=True)
        for i in range(n)
    ]
    return prompts, params


def run_mode(
    name: str, engine_args: dict, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[dict, list[list[int]]]:
    llm = LLM(**engine_args)
    engine = llm.engine
    engine.add_request("warm", prompts[0][:32], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()
    before = engine.scheduler.num_scheduled_tokens
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    tokens: list[list[int]] = [[] for _ in prompts]
    times: list[list[float]] = [[] for _ in prompts]
    total = sum(p.max_tokens for p in params)
    bar = tqdm(total=total, desc=name, unit="tok")
    start = time.perf_counter()
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            i = int(out.request_id)
            tokens[i] += out.new_token_ids
            times[i] += [now] * len(out.new_token_ids)
            bar.update(len(out.new_token_ids))
    wall = time.perf_counter() - start
    bar.close()
    engine.check_integrity()
    gaps = np.concatenate([np.diff(t) for t in times]) * 1e3
    row = {
        "mode": name,
        "output_tok_s": round(total / wall, 1),
        "itl_ms_p50": round(float(np.percentile(gaps, 50)), 2),
        "itl_ms_p99": round(float(np.percentile(gaps, 99)), 2),
        "preemptions": engine.scheduler.num_preemptions,
        "computed_tokens": engine.scheduler.num_scheduled_tokens - before,
        "host_tier_loaded_blocks": engine.stats().host_tier_loaded_blocks,
        "wall_s": round(wall, 3),
    }
    llm.close()
    return row, tokens


def measure(model: str, n: int, prompt: int, output: int, share: float, threads: int | None):
    prompts, params = _workload(n, prompt, output)
    per_request = -(-(prompt + output) // BLOCK)
    working_set = n * per_request
    cache = max(per_request + 1, int(working_set * share))
    base = dict(model=model, block_size=BLOCK, max_model_len=prompt + output, cpu_threads=threads)
    ref_row, want = run_mode("unpreempted", dict(base, num_blocks=working_set + n), prompts, params)
    llm = LLM(**base, num_blocks=per_request)
    block_bytes = llm.engine.runner.spec.bytes_per_block
    llm.close()
    host_gb = 1.2 * working_set * block_bytes / 2**30
    rows = [ref_row]
    for name, extra in (("recompute", {}), ("swap (host tier)", {"kv_offload_gb": host_gb})):
        row, got = run_mode(name, dict(base, num_blocks=cache, **extra), prompts, params)
        if got != want:
            raise AssertionError(f"{name}: tokens differ from the unpreempted run's")
        row["recomputed_tokens"] = row["computed_tokens"] - ref_row["computed_tokens"]
        rows.append(row)
    ref_row["recomputed_tokens"] = 0
    return {
        "model": model,
        "requests": n,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cache_blocks": cache,
        "working_set_blocks": working_set,
        "rows": rows,
    }


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = report["rows"]
    names = [r["mode"] for r in rows]
    fig, (ax_tput, ax_itl) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_tput.bar(names, [r["output_tok_s"] for r in rows], color="tab:green")
    ax_tput.set_ylabel("output tokens/s (higher is better)")
    ax_itl.bar(names, [r["itl_ms_p99"] for r in rows], color="tab:red")
    ax_itl.set_ylabel("ITL p99, ms (lower is better)")
    fig.suptitle(
        f"Preemption: {report['model']}, {report['requests']} x ({report['prompt_tokens']} + "
        f"{report['output_tokens']}) tokens, cache {report['cache_blocks']} of "
        f"{report['working_set_blocks']} blocks"
    )
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--cache-share", type=float, default=0.25, help="KV cache / working set")
    args = p.parse_args(argv)
    report = measure(
        args.model, args.requests, args.prompt_tokens, args.output_tokens, args.cache_share,
        args.cpu_threads,
    )  # fmt: skip
    header = ("mode", "tok/s", "ITL p50", "ITL p99", "preempt", "recomputed", "tier loads")
    print("{:<17} {:>8} {:>8} {:>8} {:>8} {:>11} {:>10}".format(*header))
    for r in report["rows"]:
        print(
            f"{r['mode']:<17} {r['output_tok_s']:>8.1f} {r['itl_ms_p50']:>8.2f} "
            f"{r['itl_ms_p99']:>8.2f} {r['preemptions']:>8} {r['recomputed_tokens']:>11} "
            f"{r['host_tier_loaded_blocks']:>10}"
        )
    write_outputs(report, args, plot)


if __name__ == "__main__":
    main()
