"""The sampler on the CPU: the fused native op against the eager path it replaced, same run.

One step of ``--batch`` rows over a ``--vocab`` vocabulary (Llama-3's 128,256 by default), random
logits, every row seeded, in three configurations: temperature only; temperature + top-k 50 +
top-p 0.9; and that plus the three penalties over a 512-token prompt and 128 outputs per row.
**eager**: the former path (``kernels.sampler.ref_sample_tokens``: softmax, topk or sort,
cumsum, the noise as a ``(B, V)`` tensor; penalties rebuilt from the rows' token lists with
``common.sampler._apply_penalties``). **fused**: ``torch.ops.pdserve.sample_tokens`` (one native
call; penalties from device counts, one new token per row counted in place). Both draw the same
tokens, checked before timing. Best of ``--rounds`` rounds.

    python -m benchmarks.sampler_cpu
    python -m benchmarks.sampler_cpu --batch 64 --vocab 128256 --threads 2
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch

import kernels  # noqa: F401 - registers torch.ops.pdserve.*
from common.sampler import SampleRow, _apply_penalties
from common.sampling_params import SamplingParams
from kernels.sampler import PARAM_WORDS, RowParams, pack_params, ref_sample_tokens

PROMPT, OUTPUTS = 512, 128


def _ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _case(batch: int, vocab: int, filters: bool, penalties: bool, rounds: int) -> tuple:
    rng = random.Random(0)
    logits = torch.randn(batch, vocab) * 3
    kw = {"top_k": 50, "top_p": 0.9} if filters else {}
    pen = {"repetition_penalty": 1.2, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    params = SamplingParams(temperature=0.8, **kw, **(pen if penalties else {}))
    rows = [
        SampleRow(
            params, rng.randrange(2**63), OUTPUTS,
            [rng.randrange(vocab) for _ in range(PROMPT)],
            [rng.randrange(vocab) for _ in range(OUTPUTS)], None,
        )
        for _ in range(batch)
    ]  # fmt: skip
    sample = (0.8, params.top_k, params.top_p, 0.0)
    plain = [RowParams(*sample, r.seed, r.position) for r in rows]
    words = torch.tensor(pack_params(plain), dtype=torch.int32).view(batch, PARAM_WORDS)
    empty = torch.zeros(0, vocab, dtype=torch.int16)

    def eager() -> torch.Tensor:
        x = _apply_penalties(logits, rows) if penalties else logits
        return ref_sample_tokens(x, words, empty)

    counts = torch.zeros(batch if penalties else 0, vocab, dtype=torch.int16)
    if penalties:  # the slots as built at a request's first step, less the last output
        for i, r in enumerate(rows):
            counts[i, r.prompt_token_ids] = -(2**15)
            counts[i].index_add_(0, torch.tensor(r.output_token_ids[:-1]),
                                 torch.ones(OUTPUTS - 1, dtype=torch.int16))  # fmt: skip
    penal = (1.2, 0.3, 0.2)
    fused_rows = [
        RowParams(*sample, r.seed, r.position, i, *penal, (r.output_token_ids[-1],))
        if penalties else plain[i]
        for i, r in enumerate(rows)
    ]  # fmt: skip
    fused_words = torch.tensor(pack_params(fused_rows), dtype=torch.int32).view(batch, -1)

    def fused(counts: torch.Tensor = counts) -> torch.Tensor:  # timed: counts drift, cost not
        return torch.ops.pdserve.sample_tokens(logits, fused_words, counts)

    drawn = fused(counts.clone())
    assert torch.equal(eager(), drawn), "the fused op draws other tokens than the eager path"
    return _ms(eager, rounds), _ms(fused, rounds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"batch {args.batch}, vocab {args.vocab}, {args.threads} threads: ms per step")
    print("| configuration | eager ms | fused ms | speed-up |\n| --- | ---: | ---: | ---: |")
    configs = {
        "temperature": (False, False),
        "+ top-k 50 + top-p 0.9": (True, False),
        "+ penalties (512 + 128 tokens)": (True, True),
    }
    for name, (filters, penalties) in configs.items():
        eager, fused = _case(args.batch, args.vocab, filters, penalties, args.rounds)
        print(f"| {name} | {eager:.1f} | {fused:.1f} | {eager / fused:.1f}x |")


if __name__ == "__main__":
    main()
