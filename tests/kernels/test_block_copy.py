"""gather_blocks / scatter_blocks against their references and per-block indexing.

A copy is exact, so every comparison here is ``torch.equal`` whatever the dtype.
"""

from __future__ import annotations

import pytest
import torch

from kernels.block_copy import gather_blocks, ref_gather_blocks, ref_scatter_blocks, scatter_blocks

CASES = [  # (dtype, num_layers, block_size, num_kv_heads, head_dim)
    (torch.float32, 2, 16, 2, 64),
    (torch.bfloat16, 3, 32, 1, 128),
    (torch.float16, 1, 16, 8, 128),
]
NUM_BLOCKS = 7


def _cache(
    dtype: torch.dtype,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> torch.Tensor:
    shape = (num_layers, 2, NUM_BLOCKS, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, device=device).to(dtype)


def _ids(ids: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64, device=device)


@pytest.mark.parametrize(("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim"), CASES)
def test_gather_matches_ref(
    dtype: torch.dtype,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> None:
    cache = _cache(dtype, num_layers, block_size, num_kv_heads, head_dim, device)
    block_ids = _ids([5, 0, 6, 2], device)
    out = gather_blocks(cache, block_ids)
    assert out.shape == (4, num_layers, 2, block_size, num_kv_heads, head_dim)
    assert torch.equal(out, ref_gather_blocks(cache, block_ids))


@pytest.mark.parametrize(("dtype", "num_layers", "block_size", "num_kv_heads", "head_dim"), CASES)
def test_scatter_matches_ref(
    dtype: torch.dtype,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> None:
    cache = _cache(dtype, num_layers, block_size, num_kv_heads, head_dim, device)
    block_ids = _ids([3, 6, 1], device)
    src = torch.randn(3, *cache[:, :, 0].shape, device=device).to(dtype)
    expected = cache.clone()
    ref_scatter_blocks(expected, block_ids, src)
    scatter_blocks(cache, block_ids, src)
    assert torch.equal(cache, expected)


def test_round_trip_moves_blocks_between_caches(device: torch.device) -> None:
    """Prefill side gathers its blocks, decode side scatters them under other ids."""
    source = _cache(torch.bfloat16, 2, 16, 2, 64, device)
    target = torch.zeros_like(source)
    packed = torch.empty(3, 2, 2, 16, 2, 64, dtype=torch.bfloat16, device=device)
    assert gather_blocks(source, _ids([4, 1, 2], device), out=packed) is packed
    scatter_blocks(target, _ids([0, 6, 3], device), packed)
    for src_id, dst_id in ((4, 0), (1, 6), (2, 3)):
        assert torch.equal(target[:, :, dst_id], source[:, :, src_id])
    for untouched in (1, 2, 4, 5):
        assert not target[:, :, untouched].any()


def test_fp8_blocks_copy_bit_exactly(device: torch.device) -> None:
    cache = _cache(torch.float8_e4m3fn, 2, 16, 2, 64, device)
    block_ids = _ids([2, 5], device)
    packed = gather_blocks(cache, block_ids)
    expected = ref_gather_blocks(cache, block_ids)
    assert torch.equal(packed.view(torch.uint8), expected.view(torch.uint8))
    target = torch.zeros_like(cache)
    scatter_blocks(target, block_ids, packed)
    assert torch.equal(target[:, :, 5].view(torch.uint8), cache[:, :, 5].view(torch.uint8))


def test_ref_gather_matches_block_indexing(device: torch.device) -> None:
    cache = _cache(torch.float32, 2, 16, 2, 64, device)
    block_ids = [6, 2, 2]  # repeats are fine for gathering
    out = ref_gather_blocks(cache, _ids(block_ids, device))
    for i, block in enumerate(block_ids):
        for layer in range(2):
            for kv in range(2):
                assert torch.equal(out[i, layer, kv], cache[layer, kv, block])


def test_empty_block_list(device: torch.device) -> None:
    cache = _cache(torch.float32, 2, 16, 2, 64, device)
    packed = gather_blocks(cache, _ids([], device))
    assert packed.shape == (0, 2, 2, 16, 2, 64)
    before = cache.clone()
    scatter_blocks(cache, _ids([], device), packed)
    assert torch.equal(cache, before)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_ids": lambda t: t.int()}, "block_ids must have dtype"),
        ({"src": lambda t: t.half()}, "src must have dtype"),
        ({"src": lambda t: t[:, :1]}, "src must have shape"),
        ({"kv_cache": lambda t: t[0]}, "kv_cache must have shape"),
        ({"src": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)}, "src must be contig"),
        (
            {"kv_cache": lambda t: t.transpose(4, 5).contiguous().transpose(4, 5)},
            "kv_cache must be contig",
        ),
    ],
)
def test_scatter_rejects_bad_arguments(change: dict, message: str, device: torch.device) -> None:
    cache = _cache(torch.float32, 2, 16, 2, 64, device)
    args = {
        "kv_cache": cache,
        "block_ids": _ids([1, 2], device),
        "src": torch.zeros(2, 2, 2, 16, 2, 64, device=device),
    }
    for name, transform in change.items():
        args[name] = transform(args[name])
    with pytest.raises(ValueError, match=message):
        scatter_blocks(**args)


def test_gather_rejects_bad_out(device: torch.device) -> None:
    cache = _cache(torch.float32, 2, 16, 2, 64, device)
    wrong_shape = torch.empty(2, 2, 2, 16, 2, 32, device=device)
    with pytest.raises(ValueError, match="out must have shape"):
        gather_blocks(cache, _ids([1, 2], device), out=wrong_shape)
    with pytest.raises(ValueError, match="out must have dtype"):
        wrong_dtype = torch.empty(2, 2, 2, 16, 2, 64, dtype=torch.bfloat16, device=device)
        gather_blocks(cache, _ids([1, 2], device), out=wrong_dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA it would run the benchmark")
def test_benchmark_explains_it_needs_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from kernels.block_copy import benchmark

    benchmark()
    assert "needs a CUDA GPU" in capsys.readouterr().out
