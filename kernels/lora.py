"""Batched multi-LoRA: each token's adapter applied in two Triton launches per projection (CUDA),
after punica's SGMV with the tokens gathered into same-adapter tiles.

```
token_slots (T,)    t:    0  1  2  3  4  5  6  7  8      each row's adapter slot, -1: none
                 slot:    2 -1  0  2  0 -1  2  2  0      (plain ints, from the scheduler)
   ── lora_tiles (host, once per step, shared by every layer) ──▶
sorted_tokens (P,)        [2 4 8 | 0 3 6 7]              rows with an adapter, grouped by slot
tiles (n, 3)              [start, count, slot]           each slot's run cut at BLOCK_M rows:
                          [0, 3, 0]  [3, 4, 2]  [0, 0, -1] …    (pad_tiles: rows that do nothing)
shrink, grid (n, R / BLOCK_N):  out[t] = x[t] a[slot]ᵀ          (T, R)  x rows gathered by token
expand, grid (n, N / BLOCK_N):  y[t] += round(s[t] b[slot]ᵀ)    (T, N)  rows scattered back
(one kernel, ``_lora_kernel``, twice: ``EXPAND`` picks store or add)
```

Why tiles of one adapter: a program multiplies up to ``BLOCK_M`` tokens by one adapter's matrix,
so each tile reads ``a[slot]`` (or a column block of ``b[slot]``) once, not once per token: a
decode batch of 64 rows over 4 adapters reads each adapter about once per projection. The
tiles are built on the host from the step's plain ints before the step and copied to the
device with its other inputs, so nothing is read back on the host inside the step; with
``pad_tiles`` their count is fixed, so the grid is too and a CUDA graph can hold the launches
(a padding tile, slot -1, returns at once).

Rounding: each product is accumulated in fp32 and rounded once to the model dtype; ``expand``
then adds that rounded product to ``y`` in fp32 and rounds again (``y + round(s bᵀ)``, as
torch's ``y += (s @ b.T)`` in the model dtype). The sums follow the tile order, so results
agree with :func:`ref_lora_shrink` / :func:`ref_lora_expand` to fp32 reassociation.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels._common import (
    FLOAT_DTYPES,
    check,
    check_dtype,
    check_inner_contiguous,
    check_runnable,
    check_same_device,
    check_shape,
    interpreted,
    next_power_of_two,
    tile_dot,
)

BLOCK_M = 16  # token rows per tile (tl.dot needs >= 16; decode batches are small)
_SHRINK_BLOCK_K = 64  # the shrink's inner dim (hidden) per step
_EXPAND_BLOCK_N = 64  # the expand's output columns per program
_MIN_BLOCK = 16  # tl.dot needs every dim >= 16


def lora_tiles(
    token_slots: list[int], block_m: int = BLOCK_M, pad_tiles: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_tokens (P,) int32, tiles (n, 3) int32)``, CPU tensors, from each token row's
    adapter slot (-1: none).

    ``sorted_tokens``: the rows with an adapter, by slot ascending, in token order within a slot
    (``[0]`` when there is none: never empty). ``tiles``: ``[start, count, slot]`` per tile,
    ``sorted_tokens[start : start + count]`` being up to ``block_m`` rows of ``slot``; with
    ``pad_tiles``, padded to that many rows with ``[0, 0, -1]`` (more tiles than that raise
    ``ValueError``: size it with :func:`max_lora_tiles`)."""
    check(1 <= block_m <= BLOCK_M, f"block_m must be in [1, {BLOCK_M}], got {block_m}")
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    rows = np.flatnonzero(slots >= 0)
    order = rows[np.argsort(slots[rows], kind="stable")]
    run_slots, run_starts, run_counts = np.unique(
        slots[order], return_index=True, return_counts=True
    )
    tiles = [
        (int(first) + offset, min(block_m, int(count) - offset), int(slot))
        for slot, first, count in zip(run_slots, run_starts, run_counts, strict=True)
        for offset in range(0, int(count), block_m)
    ]
    if pad_tiles is not None:
        check(len(tiles) <= pad_tiles, f"{len(tiles)} tiles do not fit pad_tiles={pad_tiles}")
        tiles += [(0, 0, -1)] * (pad_tiles - len(tiles))
    sorted_tokens = order if order.size else np.zeros(1, dtype=np.int64)
    return (
        torch.from_numpy(sorted_tokens.astype(np.int32)),
        torch.tensor(tiles, dtype=torch.int32).view(-1, 3),
    )


def max_lora_tiles(max_tokens: int, num_slots: int, block_m: int = BLOCK_M) -> int:
    """The most tiles :func:`lora_tiles` makes for ``max_tokens`` rows over ``num_slots``
    adapters (a ``pad_tiles`` that always fits): ``Σ ceil(n_s / m) <= (T + k (m - 1)) // m``
    for ``k = min(num_slots, T)`` slots holding ``T`` rows in all."""
    used = min(num_slots, max_tokens)
    return (max_tokens + used * (block_m - 1)) // block_m


# The tiles and sorted tokens are views into the step's input buffers, at offsets that need not
# be aligned: not specialised on alignment (the activations and weights are).
@triton.jit(do_not_specialize_on_alignment=["sorted_tokens_ptr", "tiles_ptr"])
def _lora_kernel(
    x_ptr,  # shrink: x (T, K); expand: s (T, K = R)  (row stride stride_x)
    w_ptr,  # shrink: a (S, N = R, K); expand: b (S, N, K = R)  (contiguous)
    out_ptr,  # shrink: out (T, N = R), written; expand: y (T, N), added to  (row stride_out)
    sorted_tokens_ptr,  # (P,) int32
    tiles_ptr,  # (n, 3) int32: start, count, slot
    N,
    K,
    stride_x,
    stride_out,
    EXPAND: tl.constexpr,  # add the rounded product to out (expand) or store it (shrink)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only, see tile_dot
):
    """One (tile, column block): ``out[t, cols] (+)= x[t] w[slot, cols]ᵀ`` for the tile's rows."""
    tile = tl.program_id(0)
    start = tl.load(tiles_ptr + 3 * tile)
    count = tl.load(tiles_ptr + 3 * tile + 1)
    slot = tl.load(tiles_ptr + 3 * tile + 2)
    if (slot < 0) | (count <= 0):  # a padding tile
        return
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < count
    tokens = tl.load(sorted_tokens_ptr + start + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = w_ptr + slot.to(tl.int64) * N * K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x_mask = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + tokens[:, None] * stride_x + ks[None, :], mask=x_mask, other=0.0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        wt = tl.load(w + cols[None, :] * K + ks[:, None], mask=w_mask, other=0.0)  # w[slot]ᵀ
        acc += tile_dot(x, wt, PRECISION, UPCAST)
    dtype = out_ptr.dtype.element_ty
    out = out_ptr + tokens[:, None] * stride_out + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    product = acc.to(dtype)  # rounded once
    if EXPAND:  # y + round(product), added in fp32 and rounded (torch's half-type add)
        y = tl.load(out, mask=mask, other=0.0).to(tl.float32)
        tl.store(out, (y + product.to(tl.float32)).to(dtype), mask=mask)
    else:
        tl.store(out, product, mask=mask)


def _check_args(
    names: tuple[str, str, str],
    inp: torch.Tensor,
    weight: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``inp (T, K)``, ``weight (S, N, K)`` contiguous, ``out (T, N)``, one float dtype, rows
    of ``inp``/``out`` strided; the int32 tiles as :func:`lora_tiles` makes them."""
    inp_name, weight_name, out_name = names
    check_shape(inp_name, inp, (None, None))
    num_tokens, k = inp.shape
    check_shape(weight_name, weight, (None, None, k))
    check_shape(out_name, out, (num_tokens, weight.shape[1]))
    check_dtype(inp_name, inp, FLOAT_DTYPES)
    check_dtype(weight_name, weight, (inp.dtype,))
    check_dtype(out_name, out, (inp.dtype,))
    check_inner_contiguous(inp_name, inp, 1)
    check_inner_contiguous(out_name, out, 1)
    check(weight.is_contiguous(), f"{weight_name} must be contiguous")
    check_shape("sorted_tokens", sorted_tokens, (None,))
    check_shape("tiles", tiles, (None, 3))
    for name, t in (("sorted_tokens", sorted_tokens), ("tiles", tiles)):
        check_dtype(name, t, (torch.int32,))
        check(t.is_contiguous(), f"{name} must be contiguous")
    check_same_device(**{inp_name: inp, weight_name: weight, out_name: out})
    check_same_device(**{inp_name: inp, "sorted_tokens": sorted_tokens, "tiles": tiles})


def _launch(
    inp: torch.Tensor,
    weight: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    *,
    expand: bool,
    block_n: int,
    block_k: int,
) -> None:
    check_runnable(_lora_kernel, inp.device)
    n, k = weight.shape[1], weight.shape[2]
    if tiles.shape[0] == 0 or n == 0:
        return
    _lora_kernel[(tiles.shape[0], triton.cdiv(n, block_n))](
        inp, weight, out, sorted_tokens, tiles, n, k, inp.stride(0), out.stride(0),
        EXPAND=expand, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        # fp32 models get true fp32 products (tests hold them tight); tf32 would not.
        PRECISION="ieee" if inp.dtype == torch.float32 else "tf32",
        UPCAST=interpreted(_lora_kernel),
    )  # fmt: skip


def _rank_block(rank: int) -> int:
    """The whole (padded) rank in one block, masked past ``rank``."""
    return max(next_power_of_two(rank), _MIN_BLOCK)


def lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """``out[t] = x[t] @ a[slot]ᵀ`` for every row ``t`` of a tile of ``slot``; other rows of
    ``out`` are not written.

    ``x (T, K)``, ``a (S, R, K)`` contiguous (``S`` adapter slots, ``R`` the padded rank),
    ``out (T, R)``, all in the model dtype (fp32/bf16/fp16), ``x`` and ``out`` with any row
    stride; fp32 accumulation, rounded once. ``sorted_tokens``/``tiles``: :func:`lora_tiles`
    (block_m <= ``BLOCK_M``) on ``x``'s device."""
    _check_args(("x", "a", "out"), x, a, sorted_tokens, tiles, out)
    block_n = _rank_block(a.shape[1])
    _launch(x, a, sorted_tokens, tiles, out, expand=False, block_n=block_n,
            block_k=_SHRINK_BLOCK_K)  # fmt: skip


def lora_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """``y[t] += s[t] @ b[slot]ᵀ`` for every row ``t`` of a tile of ``slot`` (``y[t] +
    round(s[t] b[slot]ᵀ)``, the product accumulated in fp32); other rows of ``y`` are not
    written.

    ``s (T, R)``, ``b (S, N, R)`` contiguous, ``y (T, N)``, one dtype; ``s`` and ``y`` with any
    row stride (``y`` may be a column slice of a fused projection's output)."""
    _check_args(("s", "b", "y"), s, b, sorted_tokens, tiles, y)
    block_k = _rank_block(b.shape[2])
    _launch(s, b, sorted_tokens, tiles, y, expand=True, block_n=_EXPAND_BLOCK_N, block_k=block_k)


def _tile_rows(sorted_tokens: torch.Tensor, tiles: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """(token rows, slot) of each tile that does something (read on the host)."""
    tokens = sorted_tokens.long()
    return [
        (tokens[start : start + count], slot)
        for start, count, slot in tiles.tolist()
        if slot >= 0 and count > 0
    ]


def _product(inp: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``inp @ weightᵀ`` accumulated in fp32 (fp64 stays fp64), rounded once to ``out_dtype``."""
    acc = torch.promote_types(inp.dtype, torch.float32)
    return (inp.to(acc) @ weight.to(acc).T).to(out_dtype)


def ref_lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """:func:`lora_shrink` in plain PyTorch (any device, fp64 too)."""
    for rows, slot in _tile_rows(sorted_tokens, tiles):
        out[rows] = _product(x[rows], a[slot], out.dtype)


def ref_lora_expand(
    s: torch.Tensor,
    b: torch.Tensor,
    sorted_tokens: torch.Tensor,
    tiles: torch.Tensor,
    y: torch.Tensor,
) -> None:
    """:func:`lora_expand` in plain PyTorch (any device, fp64 too)."""
    for rows, slot in _tile_rows(sorted_tokens, tiles):
        y[rows] = y[rows] + _product(s[rows], b[slot], y.dtype)
