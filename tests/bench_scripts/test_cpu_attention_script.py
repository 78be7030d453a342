"""benchmarks/cpu_attention.py runs end to end and reports all three timings."""

import argparse

from benchmarks.cpu_attention import run


def test_cpu_attention_benchmark_smoke():
    report = run(
        argparse.Namespace(
            batch=3,
            context=(5, 70),
            heads=(4, 2),
            head_dim=32,
            block_size=16,
            layers=2,
            repeat=2,
            json=None,
        )
    )
    for name in ("cpu", "torch", "raw_sum"):
        assert report[name]["ms"] > 0 and report[name]["GBps"] > 0
    assert report["kv_bytes_per_layer"] > 0
    assert report["cpu_vs_torch"] > 0
