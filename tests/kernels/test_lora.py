"""The multi-LoRA kernels (``kernels/lora.py``; interpreted on CPU, compiled on CUDA) against their
plain twins, the twins against a per-token loop, and the host-side tiling."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.lora import (
    BLOCK_M,
    lora_expand,
    lora_shrink,
    lora_tiles,
    max_lora_tiles,
    ref_lora_expand,
    ref_lora_shrink,
)
from kernels.warmup import ModelShape, warm_up

# (atol, rtol) against the twins: fp32 differs by the sums' order only; bf16 rounds each
# product once, so a product (and the sum y + product) may land one bf16 ulp away.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}

# 40 rows: slots 0, 1 and 3 interleaved with rows of no adapter; slot 1 has 20 rows (two tiles
# of BLOCK_M), slot 2 none.
TOKEN_SLOTS = [[1, -1, 0, 1, 3][i % 5] if i % 7 else 1 for i in range(40)]


def test_tiles_of_a_hand_example() -> None:
    slots = [2, -1, 0, 2, 0, -1, 2, 2, 0, 2]
    sorted_tokens, tiles = lora_tiles(slots, block_m=3)
    assert sorted_tokens.dtype == tiles.dtype == torch.int32
    assert sorted_tokens.device.type == tiles.device.type == "cpu"
    assert sorted_tokens.tolist() == [2, 4, 8, 0, 3, 6, 7, 9]
    assert tiles.tolist() == [[0, 3, 0], [3, 3, 2], [6, 2, 2]]

    _, padded = lora_tiles(slots, block_m=3, pad_tiles=5)
    assert padded.tolist() == [[0, 3, 0], [3, 3, 2], [6, 2, 2], [0, 0, -1], [0, 0, -1]]


def test_tiles_of_no_adapter_rows() -> None:
    sorted_tokens, tiles = lora_tiles([-1, -1])
    assert sorted_tokens.tolist() == [0] and tiles.shape == (0, 3)
    sorted_tokens, tiles = lora_tiles([], pad_tiles=2)
    assert sorted_tokens.tolist() == [0] and tiles.tolist() == [[0, 0, -1]] * 2


def test_tiles_refuse_too_few_pads_and_too_wide_tiles() -> None:
    with pytest.raises(ValueError, match="pad_tiles"):
        lora_tiles([0, 1, 2], pad_tiles=2)
    with pytest.raises(ValueError, match="block_m"):
        lora_tiles([0], block_m=BLOCK_M + 1)


@pytest.mark.parametrize(("tokens", "slots"), [(1, 4), (16, 4), (17, 2), (40, 3), (64, 64)])
def test_max_tiles_bounds_the_worst_split(tokens: int, slots: int) -> None:
    """The worst split: every slot one row, the rest on one slot just past a tile boundary."""
    used = min(slots, tokens)
    worst = [*range(used - 1), *([used - 1] * (tokens - used + 1))]
    for split in (worst, [i % slots for i in range(tokens)]):
        _, tiles = lora_tiles(split)
        assert tiles.shape[0] <= max_lora_tiles(tokens, slots)
    _, tiles = lora_tiles(worst)
    assert tiles.shape[0] == max_lora_tiles(tokens, slots)


def _weights(
    slots: int, rows: int, cols: int, rank: int, dtype: torch.dtype, g: torch.Generator
) -> torch.Tensor:
    """``(slots, rows, cols)`` adapter weights of true rank ``rank`` padded with zeros: shrink
    weights (rank in rows) when ``rows`` is the padded rank, else expand (rank in cols)."""
    w = torch.randn(slots, rows, cols, generator=g) / rank**0.5
    if rows < cols:  # a (S, R, K): rows past the rank are zero
        w[:, rank:] = 0
    else:  # b (S, N, R)
        w[:, :, rank:] = 0
    return w.to(dtype)


CASES = [(8, 16, 40, 72), (16, 32, 72, 40), (8, 24, 72, 72)]  # rank, padded R, K, N


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rank", "padded", "k", "n"), CASES)
def test_shrink_matches_the_twin(device, dtype, rank, padded, k, n) -> None:
    g = torch.Generator().manual_seed(rank * 100 + k)
    t = len(TOKEN_SLOTS)
    x = torch.randn(t, k, generator=g).to(dtype)
    a = _weights(4, padded, k, rank, dtype, g)
    sorted_tokens, tiles = lora_tiles(TOKEN_SLOTS, pad_tiles=max_lora_tiles(t, 4))
    out = torch.full((t, padded), 7.0, dtype=dtype)  # unlisted rows must stay 7
    want = out.clone()
    ref_lora_shrink(x, a, sorted_tokens, tiles, want)
    got = out.to(device, copy=True)
    args = (sorted_tokens.to(device), tiles.to(device))
    lora_shrink(x.to(device), a.to(device), *args, got)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got.cpu(), want, atol=atol, rtol=rtol)
    unlisted = torch.tensor(TOKEN_SLOTS) < 0
    assert torch.equal(got.cpu()[unlisted], out[unlisted])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("rank", "padded", "k", "n"), CASES)
def test_expand_into_a_column_slice_matches_the_twin(device, dtype, rank, padded, k, n) -> None:
    """``y`` is columns [8, 8 + N) of a wider output (row stride N + 24): the other columns and
    the rows of no adapter stay bit-identical."""
    g = torch.Generator().manual_seed(rank * 100 + n)
    t = len(TOKEN_SLOTS)
    s = torch.randn(t, padded, generator=g).to(dtype)
    s[:, rank:] = 0  # a shrink's output past the true rank
    b = _weights(4, n, padded, rank, dtype, g)
    sorted_tokens, tiles = lora_tiles(TOKEN_SLOTS, pad_tiles=max_lora_tiles(t, 4))
    wide = torch.randn(t, n + 24, generator=g).to(dtype)
    want = wide.clone()
    ref_lora_expand(s, b, sorted_tokens, tiles, want[:, 8 : 8 + n])
    got = wide.to(device, copy=True)
    args = (sorted_tokens.to(device), tiles.to(device))
    lora_expand(s.to(device), b.to(device), *args, got[:, 8 : 8 + n])
    got = got.cpu()
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    unlisted = torch.tensor(TOKEN_SLOTS) < 0
    assert torch.equal(got[unlisted], wide[unlisted])
    assert torch.equal(got[:, :8], wide[:, :8]) and torch.equal(got[:, 8 + n :], wide[:, 8 + n :])
    assert not torch.equal(got[~unlisted], wide[~unlisted])  # the listed rows did change


def test_padding_tiles_do_nothing(device) -> None:
    """Slot -1 or count 0 (the pad of ``pad_tiles``, or an empty run): nothing written."""
    x = torch.randn(6, 40, device=device)
    a = torch.randn(3, 16, 40, device=device)
    tiles = torch.tensor([[0, 0, -1], [2, 0, 1], [1, 4, -1]], dtype=torch.int32, device=device)
    sorted_tokens = torch.arange(6, dtype=torch.int32, device=device)
    out = torch.full((6, 16), 7.0, device=device)
    lora_shrink(x, a, sorted_tokens, tiles, out)
    y = torch.full((6, 40), 7.0, device=device)
    lora_expand(out, a.transpose(1, 2).contiguous(), sorted_tokens, tiles, y)
    assert (out == 7).all() and (y == 7).all()


def test_the_twins_equal_a_per_token_loop_in_fp64() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(len(TOKEN_SLOTS), 40, generator=g, dtype=torch.float64)
    a = torch.randn(4, 24, 40, generator=g, dtype=torch.float64)
    b = torch.randn(4, 72, 24, generator=g, dtype=torch.float64)
    y = torch.randn(len(TOKEN_SLOTS), 72, generator=g, dtype=torch.float64)
    shrunk, expanded = torch.zeros(len(TOKEN_SLOTS), 24, dtype=torch.float64), y.clone()
    sorted_tokens, tiles = lora_tiles(TOKEN_SLOTS, block_m=4, pad_tiles=30)
    ref_lora_shrink(x, a, sorted_tokens, tiles, shrunk)
    ref_lora_expand(shrunk, b, sorted_tokens, tiles, expanded)
    for t, slot in enumerate(TOKEN_SLOTS):
        if slot < 0:
            assert (shrunk[t] == 0).all() and torch.equal(expanded[t], y[t])
            continue
        want_s = torch.stack([sum(x[t, i] * a[slot, r, i] for i in range(40)) for r in range(24)])
        torch.testing.assert_close(shrunk[t], want_s, atol=1e-12, rtol=1e-12)
        want_y = y[t] + torch.stack([(shrunk[t] * b[slot, j]).sum() for j in range(72)])
        torch.testing.assert_close(expanded[t], want_y, atol=1e-12, rtol=1e-12)


def test_launchers_refuse_bad_arguments(device) -> None:
    x = torch.zeros(4, 40, device=device)
    a = torch.zeros(2, 16, 40, device=device)
    sorted_tokens, tiles = (t.to(device) for t in lora_tiles([0, 1, -1, 0]))
    out = torch.zeros(4, 16, device=device)
    with pytest.raises(ValueError, match="a must have dtype"):
        lora_shrink(x, a.half(), sorted_tokens, tiles, out)
    with pytest.raises(ValueError, match="out must have shape"):
        lora_shrink(x, a, sorted_tokens, tiles, out[:, :8])
    with pytest.raises(ValueError, match="tiles must have dtype"):
        lora_shrink(x, a, sorted_tokens, tiles.long(), out)
    with pytest.raises(ValueError, match="a must be contiguous"):
        lora_shrink(x, a.transpose(1, 2).contiguous().transpose(1, 2), sorted_tokens, tiles, out)
    with pytest.raises(ValueError, match="y must be contiguous in its last 1 dims"):
        lora_expand(out, a.transpose(1, 2).contiguous(), sorted_tokens, tiles, x.T.contiguous().T)


def test_warm_up_launches_every_projections_shrink_and_expands(device) -> None:
    """With ``lora_rank``: q|k|v (one shrink, three expands), o, gate|up (two), down."""
    limits = SimpleNamespace(max_tokens=8, max_blocks_per_seq=8)
    kv_cache = torch.zeros(2, 2, 8, 16, 2, 16, device=device)
    calls = [
        warm_up(ModelShape(4, 2, 16, 64, 96, lora_rank=rank), limits, kv_cache).launcher_calls
        for rank in (0, 8)
    ]
    assert calls[1] - calls[0] == 4 + 2 + 3 + 2
