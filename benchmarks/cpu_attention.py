"""CPU decode attention: the native kernel against the PyTorch path and raw memory bandwidth.

One decode step's attention for a batch of sequences over a paged cache, timed three ways in one
run: the ``cpu`` backend (native kernel, blocks read in place), the ``torch`` backend (gather
into a workspace, then SDPA), and a plain ``torch.sum`` over the same number of bytes (the
machine's read bandwidth: the ceiling for a memory-bound kernel). ``--layers`` cycles through
that many cache layers, so with the default 4 the working set is larger than a typical L3 and
blocks arrive cold, as in a real step.

    python -m benchmarks.cpu_attention                  # tiny-llama's heads: 4 q, 2 kv, d 32
    python -m benchmarks.cpu_attention --heads 32 8 --head-dim 128 --batch 16
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from common.attention import AttentionMetadata, get_attention_backend
from common.host_memory import zeros_on_huge_pages


def _time_ms(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for i in range(repeat):
        fn(i)
    return (time.perf_counter() - start) / repeat * 1e3


def run(args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    rng = random.Random(0)
    num_heads, num_kv_heads = args.heads
    lens = [rng.randint(*args.context) for _ in range(args.batch)]
    per_seq = [-(-n // args.block_size) for n in lens]
    num_blocks = max(sum(per_seq) * 2, 64)
    shape = (args.layers, 2, num_blocks, args.block_size, num_kv_heads, args.head_dim)
    cache = zeros_on_huge_pages(shape, torch.float32).normal_()
    ids = torch.randperm(num_blocks)[: sum(per_seq)].tolist()  # scattered, as after churn
    tables = torch.zeros(args.batch, max(per_seq), dtype=torch.int32)
    for s, n in enumerate(per_seq):
        tables[s, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    meta = AttentionMetadata(
        query_start_loc=torch.arange(args.batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.zeros(args.batch, dtype=torch.long),
        query_lens=[1] * args.batch,
        seq_lens_cpu=lens,
        max_query_len=1,
        max_seq_len=max(lens),
    )
    q = torch.randn(args.batch, num_heads, args.head_dim)
    kv_bytes = sum(lens) * 2 * num_kv_heads * args.head_dim * 4  # K and V, read once
    report: dict = {"config": vars(args), "kv_bytes_per_layer": kv_bytes}
    backends = {n: get_attention_backend(n, torch.device("cpu")) for n in ("cpu", "torch")}
    torch.testing.assert_close(  # a fast wrong answer is no result
        backends["cpu"].attend(q, cache[0], meta, 0.125),
        backends["torch"].attend(q, cache[0], meta, 0.125),
        atol=1e-4,
        rtol=1e-4,
    )
    for name, backend in backends.items():
        ms = _time_ms(
            lambda i=0, b=backend: b.attend(q, cache[i % args.layers], meta, 0.125), args.repeat
        )
        report[name] = {"ms": ms, "GBps": kv_bytes / ms / 1e6}
    flat = cache.view(args.layers, -1)[:, : kv_bytes // 4]
    ms = _time_ms(lambda i=0: flat[i % args.layers].sum(), args.repeat)
    report["raw_sum"] = {"ms": ms, "GBps": kv_bytes / ms / 1e6}
    report["cpu_vs_torch"] = report["torch"]["ms"] / report["cpu"]["ms"]
    report["cpu_fraction_of_raw"] = report["raw_sum"]["ms"] / report["cpu"]["ms"]
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, nargs=2, default=(16, 768))
    p.add_argument("--heads", type=int, nargs=2, default=(4, 2), metavar=("Q", "KV"))
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeat", type=int, default=100)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    report = run(args)
    for name in ("cpu", "torch", "raw_sum"):
        r = report[name]
        print(f"{name:8s} {r['ms']:.3f} ms  {r['GBps']:.1f} GB/s")
    print(
        f"native kernel: {report['cpu_vs_torch']:.2f}x the torch path, "
        f"{report['cpu_fraction_of_raw']:.0%} of raw read bandwidth"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
