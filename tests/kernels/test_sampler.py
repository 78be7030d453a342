"""sample_tokens (Triton) and sample_tokens_cpu (native) against ref_sample_tokens, token for token.

The ref is the sampler's former eager path (softmax, sort or topk, cumsum, the noise as a
``(B, V)`` tensor); the kernels must draw the same token from the same (seed, position) noise.
Ties are the one stated exception (see ``kernels/sampler.py``), so the logits here are random
floats with no ties among the largest. The Triton kernels run with small tiles (256 entries, 16
candidates each) so that a small vocabulary spans several tiles and every way pass 2 settles a
row is reached: from the candidates, from the tile winners, and by bisection over the row.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.sampler import (
    NEW_TOKENS,
    PARAM_WORDS,
    RowParams,
    exponential_noise,
    pack_params,
    ref_sample_tokens,
    sample_tokens,
    sample_tokens_cpu,
    unpack_params,
)
from tests.kernels.conftest import INTERPRETING

# (temperature, top_k, top_p, min_p): how pass 2 settles the row with tile 256, cand 16
TRITON_ROWS = [
    (0.0, -1, 1.0, 0.0),  # greedy
    (0.0, 5, 0.5, 0.1),  # greedy ignores the filters
    (1.0, -1, 1.0, 0.0),  # no filter: the tile winners
    (0.7, 10, 1.0, 0.0),  # top-k within the candidates
    (1.0, 8, 0.6, 0.0),  # top-k, then top-p over its mass
    (0.3, -1, 0.7, 0.0),  # a peaked row: the top-p prefix ends in the candidates
    (0.5, 12, 0.95, 0.2),  # all three
    (2.0, -1, 0.9, 0.0),  # a flat row: top-p by bisection
    (1.5, -1, 1.0, 0.02),  # min-p alone runs past the candidates: bisection
    (1.0, 200, 0.8, 0.0),  # top-k past the candidates: both bisections
    (1.0, -1, 1.0, 0.0),  # a grammar mask left two tiles all -inf (see test_triton_matches_ref)
]


def _params(rows, seeds, positions, device, penalties=None) -> torch.Tensor:
    """``penalties``: per row None or (slot, repetition, frequency, presence, new tokens)."""
    penalties = penalties or [None] * len(rows)
    packed = [
        RowParams(*row, seed, position, *(extra or ()))
        for row, seed, position, extra in zip(rows, seeds, positions, penalties, strict=True)
    ]
    words = pack_params(packed)
    return torch.tensor(words, dtype=torch.int32, device=device).view(len(rows), PARAM_WORDS)


def _no_counts(vocab: int, device) -> torch.Tensor:
    return torch.zeros(0, vocab, dtype=torch.int16, device=device)


def _counts(slots: int, vocab: int, device, seed: int) -> torch.Tensor:
    """Random counts: a few prompt tokens (the sign bit), a few output counts, some both."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(slots, vocab, dtype=torch.int16)
    prompt = torch.rand(slots, vocab, generator=gen) < 0.02
    counts[prompt] = -(2**15)
    counts += (torch.rand(slots, vocab, generator=gen) < 0.03) * torch.randint(
        1, 9, (slots, vocab), generator=gen, dtype=torch.int16
    )
    return counts.to(device)


def test_params_round_trip() -> None:
    seeds, positions = [2**63 - 1, 0, 2**40 + 7], [0, 2**32 + 5, 123]
    rows = [(0.0, -1, 1.0, 0.0), (0.7, 40, 0.9, 0.05), (1.5, 2**40, 0.5, 1.0)]
    extra = [None, (3, 1.2, 0.5, -0.25, (7, 9)), None]
    p = unpack_params(_params(rows, seeds, positions, torch.device("cpu"), extra))
    assert p["seeds"].tolist() == seeds
    assert p["positions"].tolist() == [0, 5, 123]  # the noise hashes the low word only
    assert p["top_k"].tolist() == [0, 40, 2**31 - 1]
    assert p["temperature"].tolist() == pytest.approx([0.0, 0.7, 1.5])
    assert p["min_p"].tolist() == pytest.approx([0.0, 0.05, 1.0])
    assert p["slot"].tolist() == [-1, 3, -1]
    assert p["penalties"][1].tolist() == pytest.approx([1.2, 0.5, -0.25])
    assert p["num_new"].tolist() == [0, 2, 0]
    assert p["new_tokens"][1].tolist() == [7, 9] + [-1] * (NEW_TOKENS - 2)


def test_ref_draws_with_the_sampler_noise() -> None:
    """A row without filters is argmax(softmax(x / T) / E) with E of common/sampler.py."""
    logits = torch.randn(3, 500)
    rows = [(0.8, -1, 1.0, 0.0)] * 3
    params = _params(rows, [1, 2, 3], [4, 5, 6], torch.device("cpu"))
    noise = exponential_noise(torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]), 500)
    expected = (torch.softmax(logits / 0.8, -1) / noise).argmax(-1)
    assert torch.equal(ref_sample_tokens(logits, params, _no_counts(500, "cpu")), expected)


def test_triton_matches_ref(device) -> None:
    vocab = 1000  # four tiles of 256, the last one partial
    logits = torch.randn(len(TRITON_ROWS), vocab, device=device) * 2.0
    logits[5] *= 4.0  # peaked
    logits[10, :512] = float("-inf")
    seeds = [random.Random(i).randrange(2**63) for i in range(len(TRITON_ROWS))]
    positions = list(range(3, 3 + len(TRITON_ROWS)))
    params = _params(TRITON_ROWS, seeds, positions, device)
    before = logits.clone()
    tokens = sample_tokens(logits, params, _no_counts(vocab, device), tile=256, cand=16)
    assert torch.equal(logits, before)  # read, never written
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == ref_sample_tokens(logits, params, _no_counts(vocab, device)).tolist()


def _flat_rows(seed: int, n: int) -> list[tuple[float, int, float, float]]:
    """Rows whose kept prefix runs past 4 tiles' 16 candidates on standard-normal logits."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        top_k = rng.choice([-1, -1, 60, 300, 900])
        top_p = rng.choice([1.0, 0.97, 0.8, 0.5])
        min_p = rng.choice([0.0, 0.0, 0.005, 0.1])
        if top_k > 0 or top_p < 1.0 or min_p > 0.0:
            rows.append((rng.choice([0.7, 1.0, 2.0]), top_k, top_p, min_p))
    return rows


@pytest.mark.slow  # ~15 s interpreted
def test_triton_cuts_match_ref_on_flat_rows(device) -> None:
    """Every mix of top-k, top-p and min-p where pass 2 must search the row for its cuts: the
    search lands where the ref's sort and cumsum cut, token for token."""
    rows = _flat_rows(seed=7, n=16)
    vocab = 1000
    logits = torch.randn(len(rows), vocab, device=device)
    logits[3, ::7] = float("-inf")  # a grammar mask inside the search
    params = _params(rows, list(range(100, 100 + len(rows))), [5] * len(rows), device)
    none = _no_counts(vocab, device)
    tokens = sample_tokens(logits, params, none, tile=256, cand=16)
    assert tokens.tolist() == ref_sample_tokens(logits, params, none).tolist()


@pytest.mark.skipif(not INTERPRETING, reason="counts the interpreter's calls of a kernel function")
@pytest.mark.parametrize(
    ("row", "most"),
    [((1.0, -1, 0.9, 0.0), 10), ((1.0, 900, 1.0, 0.0), 11), ((1.0, 900, 0.9, 0.0), 19)],
)
def test_a_cut_costs_a_few_reads_of_the_row(device, monkeypatch, row, most) -> None:
    """Pass 2's search tests 16 keys per read of the row: a cut takes at most 8 reads, plus the
    mass under each cut and the draw (a bisection took 33 per cut: 35, 36 and 69 reads)."""
    import kernels.sampler as sampler

    reads = 0
    scaled = sampler._scaled

    def counted(*args):
        nonlocal reads
        reads += 1
        return scaled(*args)

    vocab, tile = 1000, 256
    logits = torch.randn(1, vocab, device=device)
    params = _params([row], [9], [1], device)
    monkeypatch.setattr(sampler, "_scaled", counted)
    tokens = sample_tokens(logits, params, _no_counts(vocab, device), tile=tile, cand=16)
    tiles = -(-vocab // tile)  # pass 1 reads each tile once; pass 2 reads the row in tiles too
    assert tokens.tolist() == ref_sample_tokens(logits, params, _no_counts(vocab, device)).tolist()
    assert tiles < reads <= tiles + most * tiles


def test_triton_penalties_match_ref(device) -> None:
    """Rows with slots: the new tokens counted in place (each once, across tiles), then the
    penalties; greedy rows are penalised too, and a row without a slot is left alone."""
    rows = [(0.0, -1, 1.0, 0.0), (0.8, 20, 0.9, 0.0), (1.0, -1, 1.0, 0.0), (0.0, -1, 1.0, 0.0)]
    extra = [
        (2, 1.3, 0.0, 0.0, (5, 5, 700)),  # one token twice, one in the last tile
        (0, 1.1, 0.4, 0.3, (1,)),
        None,
        (1, 0.8, -0.5, 0.0, ()),  # repetition below 1 favours what was seen
    ]
    vocab = 900
    logits = torch.randn(len(rows), vocab, device=device)
    params = _params(rows, [1, 2, 3, 4], [9, 8, 7, 6], device, extra)
    counts = _counts(3, vocab, device, seed=0)
    expected_counts = counts.clone()
    expected = ref_sample_tokens(logits, params, expected_counts)
    tokens = sample_tokens(logits, params, counts, tile=256, cand=16)
    assert tokens.tolist() == expected.tolist()
    assert torch.equal(counts, expected_counts)
    assert counts[2, 5] - _counts(3, vocab, "cpu", seed=0)[2, 5].to(device) == 2


@pytest.mark.slow  # ~15 s interpreted: a sort of 4096 candidates
def test_triton_default_tiles_one_partial_tile(device) -> None:
    """The engine's tile and candidate count over a vocabulary below one tile."""
    rows = [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (0.7, 50, 0.9, 0.05)]
    logits = torch.randn(len(rows), 300, device=device)
    params = _params(rows, [11, 12, 13], [0, 1, 2], device)
    none = _no_counts(300, device)
    assert sample_tokens(logits, params, none).tolist() == (
        ref_sample_tokens(logits, params, none).tolist()
    )


def test_empty_batch(device) -> None:
    params = torch.empty(0, PARAM_WORDS, dtype=torch.int32, device=device)
    logits = torch.empty(0, 64, device=device)
    assert sample_tokens(logits, params, _no_counts(64, device)).shape == (0,)


@pytest.mark.parametrize("vocab", [7, 1000, 32000])
def test_native_matches_ref(vocab: int) -> None:
    """Many rows of every mix of filters; the native op on CPU tensors (one call)."""
    rng = random.Random(vocab)
    rows = [
        (
            rng.choice([0.0, 0.4, 1.0, 1.7]),
            rng.choice([-1, -1, 1, 3, 40, 700]),
            rng.choice([1.0, 1.0, 0.95, 0.6]),
            rng.choice([0.0, 0.0, 0.05, 0.3]),
        )
        for _ in range(96)
    ]
    logits = torch.randn(len(rows), vocab) * torch.tensor([1.0, 4.0, 10.0]).repeat(32)[:, None]
    seeds = [rng.randrange(2**63) for _ in rows]
    positions = [rng.randrange(10_000) for _ in rows]
    # every third row penalised, each in its own slot, with up to NEW_TOKENS new tokens
    extra = [
        (i // 3, *rng.choice([(1.3, 0.0, 0.0), (0.9, 0.2, 0.1), (1.0, -0.3, 0.5)]),
         tuple(rng.randrange(vocab) for _ in range(rng.randrange(NEW_TOKENS + 1))))
        if i % 3 == 0 else None
        for i in range(len(rows))
    ]  # fmt: skip
    params = _params(rows, seeds, positions, torch.device("cpu"), extra)
    counts = _counts(len(rows) // 3, vocab, "cpu", seed=vocab)
    ref_counts, again = counts.clone(), counts.clone()
    before = logits.clone()
    tokens = torch.ops.pdserve.sample_tokens(logits, params, counts)
    assert torch.equal(logits, before)
    assert tokens.tolist() == ref_sample_tokens(logits, params, ref_counts).tolist()
    assert torch.equal(counts, ref_counts)
    assert torch.equal(tokens, sample_tokens_cpu(logits, params, again))


def test_refuses_bad_params() -> None:
    logits = torch.randn(2, 10)
    params = torch.zeros(2, PARAM_WORDS, dtype=torch.int32)
    with pytest.raises(ValueError, match="params must be"):
        sample_tokens_cpu(logits, params[:, :4], _no_counts(10, "cpu"))
    with pytest.raises(ValueError, match="float32"):
        sample_tokens_cpu(logits.double(), params, _no_counts(10, "cpu"))
    with pytest.raises(ValueError, match="counts must be"):
        sample_tokens_cpu(logits, params, torch.zeros(1, 10, dtype=torch.int32))


def test_a_dropped_token_is_never_drawn_where_its_noise_rounds_to_zero(device) -> None:
    """Seed 2177, position 0: token 2138's uniform rounds to 1, its noise to 0. The former path
    divided the dropped token's prob 0 by it (NaN) and argmax drew it; now top-k 1 draws token 0."""
    seeds, positions = torch.tensor([2177]), torch.tensor([0])
    assert exponential_noise(seeds, positions, 4096)[0, 2138] == 0
    logits = torch.zeros(1, 4096, device=device)
    logits[0, 0] = 5.0
    params = _params([(1.0, 1, 1.0, 0.0)], [2177], [0], device)
    none = _no_counts(4096, device)
    assert ref_sample_tokens(logits, params, none).tolist() == [0]
    assert sample_tokens_cpu(logits.cpu(), params.cpu(), none.cpu()).tolist() == [0]
    assert sample_tokens(logits, params, none, tile=1024, cand=16).tolist() == [0]
