"""``kernels/warmup.py``: the variants it launches, that it leaves the KV cache as it was, and
that after it a varied workload through the engine's launch sites compiles nothing more."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kernels.warmup import ModelShape, prefill_query_lens, warm_up
from tests.kernels.cross_compile_child import run_child


def test_prefill_query_lens_one_per_block_m() -> None:
    # rows = next_pow2(longest query) x the GQA group, in [16, 128]
    assert prefill_query_lens(8192, 1) == [2, 17, 33, 65]  # BLOCK_M 16, 32, 64, 128
    assert prefill_query_lens(8192, 4) == [2, 5, 9, 17]
    assert prefill_query_lens(20, 8) == [2, 3, 5, 9]
    assert prefill_query_lens(4, 1) == [2]
    assert prefill_query_lens(1, 4) == []  # a one-token query is a decode


def test_warm_up_leaves_the_cache_as_it_was(device: torch.device) -> None:
    shape = ModelShape(4, 2, 16, 64, 96, qk_norm=True)
    kv_cache = torch.randn(2, 2, 8, 16, 2, 16, device=device).to(torch.bfloat16)
    before = kv_cache.clone()
    limits = SimpleNamespace(max_tokens=40, max_blocks_per_seq=40)
    report = warm_up(shape, limits, kv_cache)
    torch.testing.assert_close(kv_cache, before, atol=0, rtol=0)
    # 3 norms + rotary + silu, prefill BLOCK_M 16/32/64/128, decode BLOCK_N 16 and 64, 2 copies
    assert report.launcher_calls == 5 + 4 + 2 + 2


def test_warm_up_refuses_a_cache_of_another_shape(device: torch.device) -> None:
    shape = ModelShape(4, 2, 16, 64, 96)
    kv_cache = torch.zeros(2, 2, 8, 16, 4, 16, device=device)
    with pytest.raises(ValueError, match="kv_cache"):
        warm_up(shape, SimpleNamespace(max_tokens=8, max_blocks_per_seq=8), kv_cache)


@pytest.mark.parametrize(
    "case",
    [
        {"shape": "qwen3-0.6b", "dtype": "bfloat16", "arch": 90, "max_model_len": 4096},
        pytest.param(
            {"shape": "llama-3.2-1b", "dtype": "float16", "arch": 80, "max_model_len": 4096},
            marks=pytest.mark.slow,
        ),
    ],
    ids=lambda c: f"{c['shape']}-{c['dtype']}-sm{c['arch']}",
)
def test_no_compilation_after_warm_up(case: dict, tmp_path: Path) -> None:
    """Prefills of 5..512 tokens, later chunks, mixed batches, draft verification, eager decodes
    of 1..16 sequences over contexts of 1..4095 tokens, graph-shaped decodes, block copies."""
    answer = run_child("workload", case, tmp_path, timeout=400)
    assert answer["restored"]
    assert answer["warmed"] >= 14 and answer["steps"] == 21 and answer["launches"] > 100
    assert answer["new"] == [], "compiled after warm-up, i.e. mid-serving"
