"""reshape_and_cache against its reference; the reference against plain slot indexing.

A copy is exact, so every comparison here is ``torch.equal`` whatever the dtype.
"""

from __future__ import annotations

import pytest
import torch
import triton

from kernels._common import check_runnable
from kernels.reshape_and_cache import ref_reshape_and_cache, reshape_and_cache

CASES = [  # (dtype, block_size, num_kv_heads, head_dim)
    (torch.float32, 16, 2, 64),
    (torch.bfloat16, 32, 8, 128),
    (torch.float16, 16, 1, 128),
]


def _inputs(
    num_tokens: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_blocks = 6
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, device=device)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device)
    return key.to(dtype), torch.randn_like(key).to(dtype), cache.to(dtype)


@pytest.mark.parametrize(("dtype", "block_size", "num_kv_heads", "head_dim"), CASES)
def test_matches_ref(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int, device: torch.device
) -> None:
    key, value, cache = _inputs(9, block_size, num_kv_heads, head_dim, dtype, device)
    # Scattered slots: block starts, block ends, the last slot of the cache, and padding.
    last = cache.shape[1] * block_size - 1
    slots = [0, block_size - 1, block_size, 3 * block_size + 5, -1, last, 2, -1, 4 * block_size]
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    expected = cache.clone()
    ref_reshape_and_cache(key, value, expected, slot_mapping)
    reshape_and_cache(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_skips_padding_and_touches_nothing_else(device: torch.device) -> None:
    key, value, cache = _inputs(4, 16, 2, 64, torch.float32, device)
    before = cache.clone()
    slot_mapping = torch.tensor([-1, 17, -1, -1], dtype=torch.int64, device=device)
    reshape_and_cache(key, value, cache, slot_mapping)
    changed = (cache != before).flatten(3).any(dim=3)  # (2, N, bs): which slots changed
    assert changed.nonzero().tolist() == [[0, 1, 1], [1, 1, 1]]
    assert torch.equal(cache[0, 1, 1], key[1]) and torch.equal(cache[1, 1, 1], value[1])


def test_strided_key_from_fused_qkv(device: torch.device) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim = 5, 4, 2, 64
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=device)
    _, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], 1)
    key = k.view(num_tokens, num_kv_heads, head_dim)  # token stride = whole qkv row
    value = v.view(num_tokens, num_kv_heads, head_dim)
    cache = torch.zeros(2, 3, 16, num_kv_heads, head_dim, device=device)
    slot_mapping = torch.tensor([3, 40, 0, 17, 16], dtype=torch.int64, device=device)
    expected = cache.clone()
    ref_reshape_and_cache(key, value, expected, slot_mapping)
    reshape_and_cache(key, value, cache, slot_mapping)
    assert torch.equal(cache, expected)


def test_ref_matches_slot_indexing(device: torch.device) -> None:
    key, value, cache = _inputs(5, 16, 2, 64, torch.float32, device)
    slot_mapping = torch.tensor([7, -1, 16, 95, 33], dtype=torch.int64, device=device)
    ref_reshape_and_cache(key, value, cache, slot_mapping)
    flat_k = cache[0].reshape(-1, 2, 64)  # slot-major view: row `slot` is that token
    flat_v = cache[1].reshape(-1, 2, 64)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])


def test_empty_batch_is_a_no_op(device: torch.device) -> None:
    key, value, cache = _inputs(0, 16, 2, 64, torch.float32, device)
    before = cache.clone()
    reshape_and_cache(key, value, cache, torch.empty(0, dtype=torch.int64, device=device))
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot_mapping": lambda t: t.int()}, "slot_mapping must have dtype"),
        ({"key": lambda t: t.half()}, "key must have dtype"),
        ({"value": lambda t: t[:, :1]}, "value must have shape"),
        ({"slot_mapping": lambda t: t[:2]}, "slot_mapping must have shape"),
        ({"kv_cache_layer": lambda t: t[0]}, "kv_cache_layer must have shape"),
        ({"key": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)}, "key must be contig"),
        (
            {"kv_cache_layer": lambda t: t.transpose(2, 3).contiguous().transpose(2, 3)},
            "kv_cache_layer must be contig",
        ),
    ],
)
def test_rejects_bad_arguments(change: dict, message: str, device: torch.device) -> None:
    key, value, cache = _inputs(3, 16, 2, 64, torch.float32, device)
    args = {
        "key": key,
        "value": value,
        "kv_cache_layer": cache,
        "slot_mapping": torch.tensor([0, 1, 2], dtype=torch.int64, device=device),
    }
    for name, transform in change.items():
        args[name] = transform(args[name])
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)


def _identity(x):  # a plain function to wrap as a compiled-mode kernel
    return x


def test_compiled_kernel_refuses_cpu_tensors() -> None:
    compiled = triton.runtime.JITFunction(_identity)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_runnable(compiled, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    # From the module: the package attribute of the same name is the launcher.
    from kernels.reshape_and_cache import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
