"""Time to first token of the same prompts when their KV comes from each tier: the device's prefix
cache, the host tier (``--kv-offload-gb``), the store (a file store through the connector, as a
decode node loads it), or nowhere (the prompt is computed).

One process, one prompt set, one model; each prompt is timed alone (``max_tokens=1``), medians
over the prompts. Before each host-tier hit a filler prompt evicts the device's copy (to the
host tier), so the hit is the host tier's and not the device's; the store's engine has no host
tier and an empty device cache. Every tier gives the first token recompute gives (checked).

    python -m benchmarks.kv_tiers                          # tiny-llama, 8 prompts x 1536 tokens
    python -m benchmarks.kv_tiers --prompts 4x3072 --json out.json --plot tiers.png
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.report_io import parser, pyplot, save_figure, write_outputs
from common import LLM, SamplingParams

FIRST = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
BLOCK = 16


def _prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(length)] for _ in range(count)]


def _time(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate([prompt], FIRST, use_tqdm=False)[0]
    return (time.perf_counter() - start) * 1e3, out.outputs[0].token_ids[0]


def measure(model: str, count: int, length: int, threads: int | None) -> dict:
    prompts, fillers = _prompts(count, length, 0), _prompts(count, length, 1)
    blocks = -(-(length + 1) // BLOCK)
    common = dict(model=model, block_size=BLOCK, max_model_len=length + 8, cpu_threads=threads)
    big = dict(common, num_blocks=blocks * (count + 2))
    results: dict[str, list[float]] = {}
    firsts: dict[str, list[int]] = {}
    steps = tqdm(total=4 * count, desc="kv tiers", unit="prompt")

    def record(tier: str, llm: LLM, prompt: list[int]) -> None:
        ms, token = _time(llm, prompt)
        results.setdefault(tier, []).append(ms)
        firsts.setdefault(tier, []).append(token)
        steps.update()

    llm = LLM(**big)  # recompute, then the device's prefix cache
    _time(llm, fillers[0])  # warm-up, not measured
    for prompt in prompts:
        record("recompute", llm, prompt)
    for prompt in prompts:
        record("device", llm, prompt)
    block_bytes = llm.engine.runner.spec.bytes_per_block
    del llm
    # a device cache for one prompt and a bit, a host tier for them all
    host_gb = 1.1 * blocks * (2 * count + 1) * block_bytes / 2**30
    llm = LLM(**common, num_blocks=blocks + 4, kv_offload_gb=host_gb)
    for prompt in prompts:
        _time(llm, prompt)
    for prompt, filler in zip(prompts, fillers, strict=True):
        _time(llm, filler)  # evicts the device's copy of the prompt to the host tier
        record("host tier", llm, prompt)
    host_stats = llm.engine.stats()
    del llm
    with tempfile.TemporaryDirectory(prefix="kv-tiers-") as tmp:
        url = f"file://{tmp}/kv"
        producer = LLM(**big, kv_store=url, kv_role="producer")
        for prompt in prompts:
            _time(producer, prompt)
        producer.close()
        consumer = LLM(**big, kv_store=url, kv_role="consumer")
        _time(consumer, fillers[0])  # warm-up (a store miss), not measured
        for prompt in prompts:
            record("store (file)", consumer, prompt)
        consumer.close()
    steps.close()
    want = firsts["recompute"]
    mismatched = [tier for tier, tokens in firsts.items() if tokens != want]
    if mismatched:
        raise AssertionError(f"first tokens differ from recompute's: {mismatched}")
    base = statistics.median(results["recompute"])
    rows = [
        {
            "tier": tier,
            "ttft_ms_median": round(statistics.median(times), 2),
            "ttft_ms_max": round(max(times), 2),
            "vs_recompute": round(statistics.median(times) / base, 3),
        }
        for tier, times in results.items()
    ]
    return {
        "model": model,
        "prompts": count,
        "prompt_tokens": length,
        "host_tier_loaded_blocks": host_stats.host_tier_loaded_blocks,
        "rows": rows,
    }


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.bar([r["tier"] for r in rows], [r["ttft_ms_median"] for r in rows], color="tab:blue")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['vs_recompute']:.2f}x", (i, r["ttft_ms_median"]), ha="center",
                    va="bottom")  # fmt: skip
    ax.set_ylabel("median TTFT, ms (lower is better)")
    ax.set_title(
        f"Where the KV comes from: {report['model']}, "
        f"{report['prompts']} x {report['prompt_tokens']} tokens"
    )
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    p = parser(__doc__)
    p.add_argument("--prompts", default="8x1536", help="COUNTxTOKENS")
    args = p.parse_args(argv)
    count, length = (int(v) for v in args.prompts.lower().split("x"))
    report = measure(args.model, count, length, args.cpu_threads)
    print(f"{'tier':<14} {'TTFT ms (median)':>17} {'max':>8} {'vs recompute':>13}")
    for r in report["rows"]:
        print(
            f"{r['tier']:<14} {r['ttft_ms_median']:>17.2f} {r['ttft_ms_max']:>8.2f} "
            f"{r['vs_recompute']:>12.3f}x"
        )
    write_outputs(report, args, plot)


if __name__ == "__main__":
    main()
