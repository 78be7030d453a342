"""common/host_memory.py: the glibc tuning applies, the KV cache lands on aligned huge pages."""

from __future__ import annotations

import platform

import pytest
import torch

from common import LLM
from common.host_memory import keep_freed_host_memory, zeros_on_huge_pages

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc malloc tuning")


@glibc
def test_malloc_tuning_applies_on_glibc() -> None:
    assert keep_freed_host_memory() is True
    assert keep_freed_host_memory() is True  # idempotent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_page_tensor_is_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    t = zeros_on_huge_pages((3, 2, 5, 16, 2, 8), dtype)
    assert t.shape == (3, 2, 5, 16, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % (2 * 2**20) == 0
    assert not t.any()
    t[1, 0, 4] = 1.5
    assert float(t.sum()) == 1.5 * 16 * 2 * 8


def test_cpu_engine_kv_cache_is_aligned_for_huge_pages() -> None:
    llm = LLM(model="tiny-llama", num_blocks=64, max_model_len=512)
    cache = llm.engine.runner.kv_cache
    assert cache.data_ptr() % (2 * 2**20) == 0 and not cache.any()
