"""Fused token sampling: temperature, top-k, top-p, min-p and the seeded Gumbel draw in two kernels.

NOTE: the draw. Randomness is counter-based (``common/sampler.py``): the noise of vocabulary entry
``v`` of output position ``i`` of a request with seed ``s`` is ``E = -log(u(hash(s, i, v)))``,
``Exp(1)``, computed here inside the kernels from the same 32-bit hash. The token is
``argmax(probs / E)`` over the tokens the filters keep, where ``probs`` is the softmax of
``logits / temperature`` renormalised over the top-k ∩ top-p set, and min-p drops the tokens below
``min_p * max(probs)``. Every filter keeps a prefix of the tokens sorted by logit, so the kept set
is ``{v : x_v >= threshold}`` and only that threshold has to be found.

```
pass 1 (B × tiles programs, reads the logits once)        pass 2 (B programs)
  x = logits / T          tile max, Σ exp(x - max)  ───▶  merge: row max m, Σ exp(x - m)
  top-CAND (x, id) of the tile (a packed int64 sort) ───▶  sort the candidates, apply the filters
  tile winner of exp(x - max) / E (no filter)       ───▶  pick: argmax probs / E over the kept ones
```

Pass 2 settles a row from its candidates when its kept prefix ends inside the candidates that are
surely the row's largest (each tile's top ``CAND``: every value above the largest of the tiles'
``CAND``-th values); a row with no filter picks among the tile winners. A row whose prefix runs
past them (top-p or min-p without a small top-k over a flat distribution) reads its logits again
in pass 2: a search on the order of the float bits for each threshold, testing :data:`PIVOTS`
keys per read of the row (at most 10 reads for top-p, 11 for top-k, 19 for both, where a
bisection took 35, 36 and 69). Greedy rows (temperature 0) take the largest logit, lowest id
first, as ``argmax``.

Three implementations of one contract: :func:`sample_tokens` (Triton; CUDA),
:func:`sample_tokens_cpu` (``csrc/sampler_cpu.c``, one native call) and :func:`ref_sample_tokens`
(plain PyTorch: the sampler's eager path, with ``topk`` instead of a sort when every row's top-k
is small). They agree token for token but where two Gumbel keys are within an ulp (the exp and
log of each differ in their last bit) or tied logits straddle a cut (the ref cuts between ties,
the kernels keep every tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import native
from kernels._common import check, check_runnable

TILE = 4096  # vocabulary entries per pass-1 program
CAND = 128  # candidates each tile hands to pass 2 (fewer where the tiles are many, see below)
MAX_CANDIDATES = 4096  # pass 2 sorts at most this many per row (a larger sort compiles for minutes)
PIVOTS = 16  # keys pass 2's search for a cut tests per read of a row (bisection: 1)
SEARCH_TILE = 512  # entries per chunk of such a read: (SEARCH_TILE, PIVOTS) compares (1024 spilled)
SMALL_TOP_K = 1024  # the ref takes topk instead of a full sort when every row's top_k is below
PARAM_WORDS = 16  # int32 words per row of the packed parameters (see pack_params)
NEW_TOKENS = 4  # output tokens a row's parameters can add to its counts (see pack_params)
_NEW_TOKENS = tl.constexpr(NEW_TOKENS)
_M32 = 0xFFFFFFFF


# -- the counter-based noise --------------------------------------------------------------------
def _fmix32_t(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser on int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32  # int64 products wrap mod 2**64; the low 32 bits stay exact
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """``Exp(1)`` noise ``(B, vocab)`` that is a pure function of (seed, position, token id)."""
    lo, hi = seeds & _M32, (seeds >> 32) & _M32
    key = _fmix32_t(lo ^ _fmix32_t(hi ^ _fmix32_t((positions * 0x9E3779B1 + 0x7F4A7C15) & _M32)))
    idx = _fmix32_t((torch.arange(vocab, device=seeds.device) * 0x27D4EB2F + 0x165667B1) & _M32)
    bits = _fmix32_t(key[:, None] ^ idx[None, :])
    uniform = ((bits >> 8).float() + 0.5) * (1.0 / (1 << 24))  # in (0, 1), never 0 or 1
    return -torch.log(uniform)


@triton.jit
def _fmix32(h):
    h ^= h >> 16
    h = h * 0x85EBCA6B
    h ^= h >> 13
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _row_key(params_ptr):
    """The row's 32-bit stream key from its seed and position (uint32, wrapping as the ref)."""
    seed_lo = tl.load(params_ptr).to(tl.uint32, bitcast=True)
    seed_hi = tl.load(params_ptr + 1).to(tl.uint32, bitcast=True)
    pos = tl.load(params_ptr + 2).to(tl.uint32, bitcast=True)
    return _fmix32(seed_lo ^ _fmix32(seed_hi ^ _fmix32(pos * 0x9E3779B1 + 0x7F4A7C15)))


@triton.jit
def _noise(row_key, ids):
    """``Exp(1)`` noise of token ``ids`` (int32) for the row's stream key."""
    idx = _fmix32(ids.to(tl.uint32, bitcast=True) * 0x27D4EB2F + 0x165667B1)
    bits = _fmix32(row_key ^ idx)
    uniform = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -tl.log(uniform)


@triton.jit
def _gumbel_key(probs, row_key, ids, keep):
    """``probs / E`` where ``keep``, else -1. Where ``E`` rounds to 0 (``u`` rounded to 1: one
    entry in 2**24) it is -1 too: the former path ranked such a token below every other (its key
    was -inf), or, for a token the filters had dropped, made its key NaN and drew it."""
    noise = _noise(row_key, ids)
    return tl.where(keep & (noise > 0.0), probs / noise, -1.0)


# -- order-preserving keys ----------------------------------------------------------------------
@triton.jit
def _order_key(x):
    """An int32 that orders as the float ``x`` does (negative floats have their bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_order_key(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _pack(x, ids, V):
    """(order key, V - 1 - id) in one int64: sorted descending, larger x first, then lower id."""
    return (_order_key(x).to(tl.int64) << 32) | (V - 1 - ids).to(tl.int64)


@triton.jit
def _row_params(params_ptr):
    """(temperature, top_k, top_p, min_p) of one row of the packed parameters."""
    top_k = tl.load(params_ptr + 3)
    temperature = tl.load(params_ptr + 4).to(tl.float32, bitcast=True)
    top_p = tl.load(params_ptr + 5).to(tl.float32, bitcast=True)
    min_p = tl.load(params_ptr + 6).to(tl.float32, bitcast=True)
    return temperature, top_k, top_p, min_p


@triton.jit
def _scaled(logits_row, counts_ptr, row_params, cols, mask, V, COUNT_NEW: tl.constexpr):
    """The row's penalised ``logits / temperature`` at ``cols`` (a greedy row's are not divided),
    ``-inf`` past the vocabulary. ``COUNT_NEW``: first add the row's new output tokens to its
    counts (pass 1, once per entry); pass 2 reads the counts as pass 1 left them."""
    x = tl.load(logits_row + cols, mask=mask, other=float("-inf"))
    slot = tl.load(row_params + 7)
    if slot >= 0:
        counts = counts_ptr + slot.to(tl.int64) * V
        c = tl.load(counts + cols, mask=mask, other=0).to(tl.int32)  # sign bit: in the prompt
        if COUNT_NEW:
            j = tl.arange(0, _NEW_TOKENS)
            new = tl.load(row_params + 12 + j)
            fresh = (cols[:, None] == new[None, :]) & (j[None, :] < tl.load(row_params + 11))
            hits = tl.sum(fresh.to(tl.int32), axis=1)
            c += hits
            tl.store(counts + cols, c.to(tl.int16), mask=mask & (hits > 0))
        count = (c & 0x7FFF).to(tl.float32)
        repetition = tl.load(row_params + 8).to(tl.float32, bitcast=True)
        frequency = tl.load(row_params + 9).to(tl.float32, bitcast=True)
        presence = tl.load(row_params + 10).to(tl.float32, bitcast=True)
        penalised = tl.where(x > 0, x / repetition, x * repetition)
        x = tl.where(c != 0, penalised, x)
        x = x - frequency * count - presence * (count > 0).to(tl.float32)
    temperature = tl.load(row_params + 4).to(tl.float32, bitcast=True)
    return x / tl.where(temperature > 0.0, temperature, 1.0)


# -- pass 1 -------------------------------------------------------------------------------------
@triton.jit
def _sample_tiles_kernel(
    logits_ptr,
    params_ptr,  # (B, PARAM_WORDS) int32
    counts_ptr,  # (slots, V) int16, the rows' penalty counts (updated with their new tokens)
    tile_stats_ptr,  # (B, NUM_TILES, 4) fp32: max, Σ exp(x - max), CAND-th value, winner's x
    tile_winner_ptr,  # (B, NUM_TILES) int32
    candidates_ptr,  # (B, NUM_TILES, CAND) int64, packed, best first
    stride_logits,
    V,
    NUM_TILES: tl.constexpr,
    TILE: tl.constexpr,
    CAND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    row_params = params_ptr + row * 16
    cols = tile * TILE + tl.arange(0, TILE)
    mask = cols < V
    x = _scaled(logits_ptr + row * stride_logits, counts_ptr, row_params, cols, mask, V, True)
    x_max = tl.max(x, axis=0)
    # a tile the grammar mask emptied (all -inf) has no mass: exp(-inf - 0), not exp(NaN)
    e = tl.where(mask, tl.exp(x - tl.where(x_max > float("-inf"), x_max, 0.0)), 0.0)
    gumbel = _gumbel_key(e, _row_key(row_params), cols, mask)
    winner = tl.argmax(gumbel, axis=0)
    winner_x = tl.max(tl.where(cols == tile * TILE + winner, x, float("-inf")), axis=0)
    packed = tl.where(mask, _pack(x, cols, V), -(2**63))
    top = tl.topk(packed, CAND)  # (CAND,), best first
    num_real = tl.minimum(V - tile * TILE, TILE)
    low = tl.where(
        num_real > CAND, _from_order_key((tl.min(top, axis=0) >> 32).to(tl.int32)), float("-inf")
    )
    stats = tile_stats_ptr + (row * NUM_TILES + tile) * 4
    tl.store(stats, x_max)
    tl.store(stats + 1, tl.sum(e, axis=0))
    tl.store(stats + 2, low)
    tl.store(stats + 3, winner_x)
    tl.store(tile_winner_ptr + row * NUM_TILES + tile, tile * TILE + winner.to(tl.int32))
    tl.store(candidates_ptr + (row * NUM_TILES + tile) * CAND + tl.arange(0, CAND), top)


# -- pass 2 -------------------------------------------------------------------------------------
@triton.jit
def _sample_pick_kernel(
    logits_ptr,
    params_ptr,
    counts_ptr,
    tile_stats_ptr,
    tile_winner_ptr,
    candidates_ptr,
    tokens_ptr,  # (B,) int64
    stride_logits,
    V,
    NUM_TILES: tl.constexpr,
    TILES_POW2: tl.constexpr,
    TILE: tl.constexpr,
    CAND: tl.constexpr,
    SEARCH_TILE: tl.constexpr,
    PIVOTS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_params = params_ptr + row * 16
    temperature, top_k, top_p, min_p = _row_params(row_params)
    row_key = _row_key(row_params)
    t = tl.arange(0, TILES_POW2)
    t_mask = t < NUM_TILES
    stats = tile_stats_ptr + (row * NUM_TILES + t) * 4
    t_max = tl.load(stats, mask=t_mask, other=float("-inf"))
    m = tl.max(t_max, axis=0)
    s = tl.sum(tl.load(stats + 1, mask=t_mask, other=0.0) * tl.exp(t_max - m), axis=0)
    low = tl.max(tl.load(stats + 2, mask=t_mask, other=float("-inf")), axis=0)
    # the candidates, best first; those above `low` are surely the row's largest values
    n = tl.arange(0, TILES_POW2 * CAND)
    packed = tl.load(
        candidates_ptr + row * NUM_TILES * CAND + n, mask=n < NUM_TILES * CAND, other=-(2**63)
    )
    packed = tl.sort(packed, descending=True)
    real = packed != -(2**63)
    x = _from_order_key((packed >> 32).to(tl.int32))
    ids = V - 1 - packed.to(tl.int32)  # the low word
    num_valid = tl.sum((real & (x > low)).to(tl.int32), axis=0)
    # the filters over the sorted candidates, as the ref applies them
    k = tl.where((top_k > 0) & (top_k < V), top_k, V)
    e = tl.where(real, tl.exp(x - m), 0.0)
    in_k = n < k
    s_k = tl.where(k < V, tl.sum(tl.where(in_k, e, 0.0), axis=0), s)
    p = e / s_k
    keep = real & in_k & ((tl.cumsum(p, axis=0) - p < top_p) | (n == 0))
    probs = e / tl.sum(tl.where(keep, e, 0.0), axis=0)
    keep = keep & (probs >= min_p * tl.max(tl.where(keep, probs, 0.0), axis=0))
    num_kept = tl.sum(keep.to(tl.int32), axis=0)
    settled = (k <= num_valid) | ((k == V) & (num_kept < num_valid)) | (num_valid >= V)
    gumbel = _gumbel_key(probs, row_key, ids, keep)
    token = tl.sum(tl.where(n == tl.argmax(gumbel, axis=0), ids, 0), axis=0)
    no_filter = (k == V) & (top_p >= 1.0) & (min_p <= 0.0)
    if no_filter & ~settled:  # the best of the tile winners
        winners = tl.load(tile_winner_ptr + row * NUM_TILES + t, mask=t_mask, other=0)
        winner_x = tl.load(stats + 3, mask=t_mask, other=float("-inf"))
        winner_key = _gumbel_key(tl.exp(winner_x - m) / s, row_key, winners, t_mask)
        token = tl.sum(tl.where(t == tl.argmax(winner_key, axis=0), winners, 0), axis=0)
    if (temperature > 0.0) & ~settled & ~no_filter:  # the kept prefix runs past the candidates
        row_logits = logits_ptr + row * stride_logits
        token = _sample_by_thresholds(
            row_logits, counts_ptr, row_params, row_key, V, k, top_p, min_p, m, s, SEARCH_TILE,
            PIVOTS,
        )  # fmt: skip
    token = tl.where(temperature > 0.0, token, tl.sum(tl.where(n == 0, ids, 0), axis=0))
    tl.store(tokens_ptr + row, token.to(tl.int64))


@triton.jit
def _above(row_logits, counts_ptr, row_params, V, m, pivots, floor, MASS: tl.constexpr,
           TILE: tl.constexpr):  # fmt: skip
    """One read of the row for every pivot (int64 order keys) at once: the number of tokens whose
    key is above it, or (``MASS``) Σ exp(x - m) over those whose key is also >= ``floor``. Every
    pivot's sum adds the same terms in the same order, so a lower pivot never gets less mass."""
    count = tl.zeros(pivots.shape, tl.int32)
    mass = tl.zeros(pivots.shape, tl.float32)
    for start in range(0, V, TILE):
        cols = start + tl.arange(0, TILE)
        mask = cols < V
        x = _scaled(row_logits, counts_ptr, row_params, cols, mask, V, False)
        key = _order_key(x).to(tl.int64)
        hit = mask[:, None] & (key[:, None] > pivots[None, :])  # (TILE, PIVOTS)
        if MASS:
            e = tl.where(mask & (key >= floor), tl.exp(x - m), 0.0)
            mass += tl.sum(tl.where(hit, e[:, None], 0.0), axis=0)
        else:
            count += tl.sum(hit.to(tl.int32), axis=0)
    return count, mass


@triton.jit
def _split(lo, hi, PIVOTS: tl.constexpr):
    """``PIVOTS`` keys spread over (lo, hi), the last one above ``lo`` whenever hi - lo > 1."""
    j = tl.arange(0, PIVOTS).to(tl.int64) + 1
    return lo + (hi - lo) * j // (PIVOTS + 1)


@triton.jit
def _narrow(lo, hi, pivots, below):
    """The new (lo, hi) of a search where ``below`` (falses, then trues, over ascending pivots)
    says the answer is at or under the pivot."""
    return tl.max(tl.where(below, lo, pivots), axis=0), tl.min(tl.where(below, pivots, hi), axis=0)


@triton.jit
def _sample_by_thresholds(
    row_logits, counts_ptr, row_params, row_key, V, k, top_p, min_p, m, s,
    TILE: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """A row whose kept prefix runs past its candidates: each cut found by a ``PIVOTS + 1``-way
    search over the order keys (at most 8 reads of the row per cut at 16 pivots, where a bisection
    takes 33), then the draw over ``key >= cut`` (one read)."""
    bottom = tl.full([], -(2**31) - 1, tl.int64)  # below every order key
    top = _order_key(m).to(tl.int64)
    floor = bottom
    s_k = s
    if k < V:  # the k-th largest value: the smallest key with fewer than k tokens above it
        lo, hi = bottom, top
        while hi - lo > 1:
            pivots = _split(lo, hi, PIVOTS)
            count, _ = _above(row_logits, counts_ptr, row_params, V, m, pivots, bottom, False, TILE)
            lo, hi = _narrow(lo, hi, pivots, count < k)
        floor = hi
        _, mass = _above(
            row_logits, counts_ptr, row_params, V, m, tl.full([PIVOTS], 0, tl.int64) + floor - 1,
            floor, True, TILE,
        )  # fmt: skip
        s_k = tl.max(mass, axis=0)
    cut = floor
    if top_p < 1.0:  # the smallest key with less than top_p of the top-k mass above it
        lo, hi = floor - 1, top
        while hi - lo > 1:
            pivots = _split(lo, hi, PIVOTS)
            _, mass = _above(row_logits, counts_ptr, row_params, V, m, pivots, floor, True, TILE)
            lo, hi = _narrow(lo, hi, pivots, mass / s_k < top_p)
        cut = hi
    _, mass = _above(
        row_logits, counts_ptr, row_params, V, m, tl.full([PIVOTS], 0, tl.int64) + cut - 1, cut,
        True, TILE,
    )  # fmt: skip
    s_kept = tl.max(mass, axis=0)
    p_floor = min_p * (1.0 / s_kept)  # min_p times the largest prob, exp(m - m) / s_kept
    best_key = tl.full([], -2.0, tl.float32)
    best_id = tl.full([], 0, tl.int32)
    for start in range(0, V, TILE):
        cols = start + tl.arange(0, TILE)
        mask = cols < V
        x = _scaled(row_logits, counts_ptr, row_params, cols, mask, V, False)
        probs = tl.exp(x - m) / s_kept
        keep = mask & (_order_key(x).to(tl.int64) >= cut) & (probs >= p_floor)
        gumbel = _gumbel_key(probs, row_key, cols, keep)
        chunk_best = tl.max(gumbel, axis=0)
        better = chunk_best > best_key
        best_id = tl.where(better, start + tl.argmax(gumbel, axis=0).to(tl.int32), best_id)
        best_key = tl.where(better, chunk_best, best_key)
    return best_id


# -- launchers ----------------------------------------------------------------------------------
class RowParams(NamedTuple):
    """What one row asks of :func:`sample_tokens`."""

    temperature: float  # 0: greedy
    top_k: int  # <= 0: none
    top_p: float
    min_p: float
    seed: int
    position: int
    slot: int = -1  # the row of ``counts`` holding its penalty counts; -1: no penalties
    repetition: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    new_tokens: tuple[int, ...] = ()  # output tokens pass 1 adds to the slot's counts first


def pack_params(rows: Sequence[RowParams]) -> np.ndarray:
    """The rows as ``(B, PARAM_WORDS)`` int32 (one upload for the step): :func:`pack_columns` of
    their fields."""
    if not rows:
        return np.empty((0, PARAM_WORDS), dtype=np.int32)
    return pack_columns(*zip(*rows, strict=True))


def pack_columns(
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
    seed: Sequence[int],
    position: Sequence[int],
    slot: Sequence[int] | None = None,
    repetition: Sequence[float] | None = None,
    frequency: Sequence[float] | None = None,
    presence: Sequence[float] | None = None,
    new_tokens: Sequence[tuple[int, ...]] | None = None,
) -> np.ndarray:
    """:class:`RowParams`' fields, a column each (the penalties' ``None``: no row has any), as
    ``(B, PARAM_WORDS)`` int32 rows, packed by numpy (a step samples hundreds of rows): the
    seed's low and high words, the position's low word, ``top_k`` (clamped to [0, 2**31 - 1]),
    the float32 bits of temperature, top_p and min_p, ``slot``, the bits of the three penalties,
    the number of new tokens and up to :data:`NEW_TOKENS` of them (-1 after the last)."""
    words = np.empty((len(temperature), PARAM_WORDS), dtype=np.int32)
    seeds = np.asarray(seed, dtype=np.uint64)  # (a negative or 65-bit seed raises)
    words[:, 0] = (seeds & _M32).astype(np.uint32).view(np.int32)
    words[:, 1] = (seeds >> np.uint64(32)).astype(np.uint32).view(np.int32)
    positions = np.asarray(position, dtype=np.uint64) & _M32  # the noise hashes the low word
    words[:, 2] = positions.astype(np.uint32).view(np.int32)
    words[:, 3] = np.clip(np.asarray(top_k, dtype=np.int64), 0, 2**31 - 1)
    floats = np.asarray([temperature, top_p, min_p], dtype=np.float32)
    words[:, 4:7] = floats.view(np.int32).T
    if slot is None:
        words[:, 7:16] = _NO_PENALTY_WORDS
        return words
    words[:, 7] = slot
    penalties = np.asarray([repetition, frequency, presence], dtype=np.float32)
    words[:, 8:11] = penalties.view(np.int32).T
    assert new_tokens is not None
    counts = np.fromiter(map(len, new_tokens), dtype=np.int64, count=len(new_tokens))
    check(bool((counts <= NEW_TOKENS).all()), f"at most {NEW_TOKENS} new tokens per row")
    words[:, 11] = counts
    words[:, 12:16] = -1
    for row in np.flatnonzero(counts):  # only rows with penalties have new tokens
        words[row, 12 : 12 + counts[row]] = new_tokens[row]
    return words


# words 7-15 of a row without penalties: no slot, neutral penalties, no new tokens
_NO_PENALTY_WORDS = np.array(
    [-1, *np.array([1.0, 0.0, 0.0], dtype=np.float32).view(np.int32), 0] + [-1] * NEW_TOKENS,
    dtype=np.int32,
)


def _check_args(logits: torch.Tensor, params: torch.Tensor, counts: torch.Tensor) -> None:
    check(
        logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1,
        f"logits must be (B, V) float32 with unit-stride rows, got {tuple(logits.shape)} "
        f"{logits.dtype} strides {tuple(logits.stride())}",
    )
    check(
        params.shape == (logits.shape[0], PARAM_WORDS)
        and params.dtype == torch.int32
        and params.is_contiguous(),
        f"params must be contiguous ({logits.shape[0]}, {PARAM_WORDS}) int32, got "
        f"{tuple(params.shape)} {params.dtype}",
    )
    check(
        counts.dim() == 2
        and counts.shape[1] == logits.shape[1]
        and counts.dtype == torch.int16
        and counts.is_contiguous(),
        f"counts must be contiguous (slots, {logits.shape[1]}) int16, got "
        f"{tuple(counts.shape)} {counts.dtype}",
    )
    check(
        logits.device == params.device == counts.device,
        "logits, params and counts must be on one device",
    )
    check(logits.shape[1] < 2**31, "vocabulary must fit in int32")


def sample_tokens(
    logits: torch.Tensor,
    params: torch.Tensor,
    counts: torch.Tensor,
    *,
    tile: int = TILE,
    cand: int | None = None,
) -> torch.Tensor:
    """One token per row (Triton, two launches). Reads ``logits`` and never modifies them.

    Args:
        logits: ``(B, V)`` float32, rows dense (the row stride free).
        params: ``(B, PARAM_WORDS)`` int32 from :func:`pack_params`, on ``logits``' device.
        counts: ``(slots, V)`` int16 penalty counts, one row per slot (the sign bit: the token
            is in the prompt; the low 15 bits: its count in the output). **Mutated**: each row
            with a slot adds its ``new_tokens`` to that slot's counts before it is penalised.
            Two rows must not share a slot. ``(0, V)`` when no row has penalties.
        tile, cand: pass 1's tile width and candidates per tile (powers of two, cand <= tile);
            the engine keeps the defaults (``CAND``, or ``MAX_CANDIDATES`` over the tile count
            rounded up to a power of two: 64 for a 151,936-entry vocabulary), the interpreted
            tests take small ones.

    Returns ``(B,)`` int64 token ids.
    """
    _check_args(logits, params, counts)
    check_runnable(_sample_tiles_kernel, logits.device)
    num_tiles = triton.cdiv(logits.shape[1], tile)
    if cand is None:
        cand = min(CAND, tile, max(MAX_CANDIDATES // triton.next_power_of_2(num_tiles), 1))
    check(0 < cand <= tile and cand & (cand - 1) == 0 == tile & (tile - 1), "tile, cand: 2**i")
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return tokens
    stats = torch.empty(rows, num_tiles, 4, dtype=torch.float32, device=logits.device)
    winners = torch.empty(rows, num_tiles, dtype=torch.int32, device=logits.device)
    candidates = torch.empty(rows, num_tiles, cand, dtype=torch.int64, device=logits.device)
    # no FMA contraction: the penalties round as the ref's separate multiply and subtract
    _sample_tiles_kernel[(rows, num_tiles)](
        logits, params, counts, stats, winners, candidates, logits.stride(0), vocab,
        NUM_TILES=num_tiles, TILE=tile, CAND=cand, num_warps=8, enable_fp_fusion=False,
    )  # fmt: skip
    _sample_pick_kernel[(rows,)](
        logits, params, counts, stats, winners, candidates, tokens, logits.stride(0), vocab,
        NUM_TILES=num_tiles, TILES_POW2=triton.next_power_of_2(num_tiles), TILE=tile,
        CAND=cand, SEARCH_TILE=min(tile, SEARCH_TILE), PIVOTS=PIVOTS, num_warps=16,
        enable_fp_fusion=False,
    )  # fmt: skip
    return tokens


def sample_tokens_cpu(
    logits: torch.Tensor, params: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """:func:`sample_tokens` on CPU tensors by one native call (no compiler: the ref)."""
    _check_args(logits, params, counts)
    native.check_cpu(logits)
    lib = native.load_library()
    if lib is None:
        return ref_sample_tokens(logits, params, counts)
    rows, vocab = logits.shape
    tokens = torch.empty(rows, dtype=torch.int64)
    failed = lib.pdserve_sample_tokens(
        tokens.data_ptr(), logits.data_ptr(), params.data_ptr(), counts.data_ptr(), rows,
        vocab, logits.stride(0), torch.get_num_threads(),
    )  # fmt: skip
    if failed:
        raise MemoryError("native sample_tokens could not allocate its scratch rows")
    return tokens


def warm_up_sampler(vocab: int, device: torch.device) -> int:
    """Launch (so compile) both kernels over ``vocab``, as the engine launches them: their one
    variant per vocabulary. Rows: greedy, and temperature with top-p and penalties (slot 0).
    Returns the number of launcher calls (1)."""
    rows = [RowParams(0.0, -1, 1.0, 0.0, 0, 0), RowParams(1.0, -1, 0.9, 0.0, 0, 0, 0, 1.1)]
    params = torch.tensor(pack_params(rows), dtype=torch.int32, device=device).view(2, -1)
    counts = torch.zeros(1, vocab, dtype=torch.int16, device=device)
    sample_tokens(torch.zeros(2, vocab, device=device), params, counts)
    return 1


# -- the reference: the sampler's eager path ----------------------------------------------------
def unpack_params(params: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`pack_params`' columns as tensors on ``params``' device (views and small casts)."""
    words = params.view(-1, PARAM_WORDS)
    as_float = words.view(torch.float32)
    low = words[:, 0].to(torch.int64) & _M32
    return {
        "seeds": low | (words[:, 1].to(torch.int64) << 32),
        "positions": words[:, 2].to(torch.int64) & _M32,
        "top_k": words[:, 3].to(torch.int64),
        "temperature": as_float[:, 4],
        "top_p": as_float[:, 5],
        "min_p": as_float[:, 6],
        "slot": words[:, 7],
        "penalties": as_float[:, 8:11],  # repetition, frequency, presence
        "num_new": words[:, 11],
        "new_tokens": words[:, 12:],
    }


def ref_sample_tokens(
    logits: torch.Tensor, params: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """:func:`sample_tokens` in plain PyTorch (any device), op for op the sampler's former path
    (``counts`` mutated the same way)."""
    p = unpack_params(params)
    logits = ref_penalise(logits, p, counts)
    greedy = logits.argmax(dim=-1)
    temperature = p["temperature"][:, None]
    scaled = logits / torch.where(temperature > 0, temperature, 1.0)
    top_k = p["top_k"].tolist()
    probs = torch.softmax(ref_top_k_top_p(scaled, top_k, p["top_p"]), dim=-1)
    min_p = p["min_p"][:, None]
    probs = torch.where(probs < min_p * probs.amax(-1, keepdim=True), 0.0, probs)
    noise = exponential_noise(p["seeds"], p["positions"], logits.shape[-1])
    drawn = torch.where(noise > 0, probs / noise, -1.0).argmax(dim=-1)  # see _gumbel_key
    return torch.where(p["temperature"] > 0, drawn, greedy)


def ref_penalise(
    logits: torch.Tensor, p: dict[str, torch.Tensor], counts: torch.Tensor
) -> torch.Tensor:
    """Each row with a slot: its new tokens counted, then repetition (prompt + output, HF/vLLM
    semantics), frequency and presence (output only) penalties, on a copy of ``logits``."""
    slots = p["slot"].tolist()
    if all(slot < 0 for slot in slots):
        return logits
    logits = logits.clone()
    for i, slot in enumerate(slots):
        if slot < 0:
            continue
        for token in p["new_tokens"][i, : p["num_new"][i]].tolist():
            counts[slot, token] += 1
        c = counts[slot].to(torch.int32)
        count = (c & 0x7FFF).float()
        repetition, frequency, presence = p["penalties"][i]
        penalised = torch.where(logits[i] > 0, logits[i] / repetition, logits[i] * repetition)
        row = torch.where(c != 0, penalised, logits[i])
        logits[i] = row - frequency * count - presence * (count > 0).float()
    return logits


def ref_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: torch.Tensor) -> torch.Tensor:
    """``logits`` with what top-k, then top-p over the top-k's renormalised probs, drop set to
    ``-inf`` (the best token always survives). ``top_k``: per row, <= 0 or >= V for none.
    Every row's top-k below :data:`SMALL_TOP_K` (and no top-p past it): ``topk``, not a sort."""
    V = logits.shape[-1]
    ks = [k if 0 < k < V else V for k in top_k]
    if all(k == V for k in ks) and bool((top_p >= 1.0).all()):
        return logits
    width = max(ks, default=V)
    if width >= SMALL_TOP_K or width == V:
        width = V
    sorted_logits, order = logits.topk(width, dim=-1) if width < V else logits.sort(-1, True)
    rank = torch.arange(width, device=logits.device)[None, :]
    drop = rank >= torch.tensor(ks, device=logits.device)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False  # the best token always survives
    out = torch.full_like(logits, float("-inf")) if width < V else torch.empty_like(logits)
    return out.scatter_(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
