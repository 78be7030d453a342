"""The fused decoder-layer ops on the CPU: each native op against its PyTorch ``ref_*``.

Times one call of each ``torch.ops.pdserve.*`` op (dispatch, argument checks, one native call)
and of the ``ref_*`` it replaces (HF's op sequence, several dispatched ops) at decode sizes: a
few rows of tiny models' widths and of Llama-3.2-1B's (hidden 2048, MLP 8192, 32 q / 8 kv heads
of 64); decode attention over a short context (CONTEXT tokens per row), where the fixed cost of
a call shows; a MoE MLP's decode step (``moe_decode``: MOE_EXPERTS experts, top MOE_TOP_K, each
of a quarter of the dense MLP's width) against the PyTorch path it replaces. Each op is checked
against its ref before it is timed: a fast wrong answer is no result (exact where the op is
bit-exact, else within TOLERANCE).

    python -m benchmarks.fused_ops_cpu
    python -m benchmarks.fused_ops_cpu --rows 1 16 64 --dtype bfloat16 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

import kernels  # registers torch.ops.pdserve.*
from kernels import native
from kernels.activation import ref_silu_and_mul
from kernels.moe_cpu import ref_moe_decode
from kernels.paged_decode_attention import ref_paged_decode_attention
from kernels.rms_norm import ref_fused_add_rms_norm, ref_rms_norm
from kernels.rotary import ref_rotary_embedding_and_cache, rope_cos_sin_cache

# hidden -> (intermediate, q heads, kv heads, head dim): tiny models' shapes, Llama-3.2-1B's
MODELS = {128: (512, 4, 2, 32), 256: (1024, 4, 2, 64), 2048: (8192, 32, 8, 64)}
EPS = 1e-5
CONTEXT, BLOCK_SIZE = 64, 16  # decode attention: tokens per row, tokens per cache block
# decode attention and moe_decode sum in another order than their refs: held to these (atol, rtol)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
MOE_EXPERTS, MOE_TOP_K = 8, 2


def _us_per_call(fn: Callable[[], object], calls: int = 200, rounds: int = 7) -> float:
    """The best of `rounds` rounds of `calls` calls (fewer where one call is slow: a round takes
    about 50 ms at most): other processes only ever add time."""
    start = time.perf_counter()
    fn()
    calls = max(1, min(calls, int(0.05 / (time.perf_counter() - start))))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


class Case(NamedTuple):
    fused: Callable[[], object]
    ref: Callable[[], object]
    mutated: torch.Tensor | None = None  # an input both write (the same values)
    exact: bool = True  # bit-exact with the ref, else within TOLERANCE


def _cases(rows: int, hidden: int, dtype: torch.dtype) -> dict[str, Case]:
    """op name -> its calls on fresh inputs of one size."""
    intermediate, heads, kv_heads, head_dim = MODELS[hidden]
    ops = torch.ops.pdserve
    x, residual = torch.randn(2, rows, hidden).to(dtype)
    weight = torch.randn(hidden).to(dtype)
    gate_up = torch.randn(rows, 2 * intermediate).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(dtype)
    positions = torch.randint(0, 4096, (rows,))
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = rope_cos_sin_cache(inv_freq, 4096, dtype)
    cache = torch.zeros(2, 64, 16, kv_heads, head_dim, dtype=dtype)
    slots = torch.randperm(64 * 16)[:rows]
    rope = (qkv, positions, cos_sin, cache, slots, heads, kv_heads)
    query = torch.randn(rows, heads, head_dim).to(dtype)
    blocks = rows * CONTEXT // BLOCK_SIZE
    kv_layer = torch.randn(2, blocks, BLOCK_SIZE, kv_heads, head_dim).to(dtype)
    tables = torch.randperm(blocks, dtype=torch.int32).view(rows, CONTEXT // BLOCK_SIZE)
    seq_lens = torch.full((rows,), CONTEXT, dtype=torch.int32)
    starts = torch.arange(rows + 1, dtype=torch.int32)
    scale = head_dim**-0.5
    expert_inter = intermediate // 4
    moe = (
        x, torch.randn(MOE_EXPERTS, hidden).to(dtype) * 0.3,
        (torch.randn(MOE_EXPERTS, 2 * expert_inter, hidden) * hidden**-0.5).to(dtype),
        (torch.randn(MOE_EXPERTS, hidden, expert_inter) * expert_inter**-0.5).to(dtype),
        MOE_TOP_K, True, True,
    )  # fmt: skip
    return {
        "rms_norm": Case(
            lambda: ops.rms_norm(x, weight, EPS),
            lambda: ref_rms_norm(x, weight, EPS),
        ),
        "fused_add_rms_norm": Case(
            lambda: ops.fused_add_rms_norm(x, residual, weight, EPS),
            lambda: ref_fused_add_rms_norm(x, residual, weight, EPS),
        ),
        "silu_and_mul": Case(
            lambda: ops.silu_and_mul(gate_up),
            lambda: ref_silu_and_mul(gate_up),
        ),
        "rotary_embedding_and_cache": Case(
            lambda: ops.rotary_embedding_and_cache(*rope),
            lambda: ref_rotary_embedding_and_cache(*rope),
            cache,
        ),
        "paged_decode_attention_cpu": Case(
            lambda: ops.paged_decode_attention_cpu(
                query, kv_layer, tables, seq_lens, starts, CONTEXT, scale
            ),
            lambda: ref_paged_decode_attention(query, kv_layer, tables, seq_lens, scale),
            exact=False,
        ),
        "moe_decode": Case(lambda: ops.moe_decode(*moe), lambda: ref_moe_decode(*moe), exact=False),
    }


def _same(a: object, b: object, exact: bool) -> bool:
    if isinstance(a, tuple):
        return all(_same(x, y, exact) for x, y in zip(a, b, strict=True))  # type: ignore[arg-type]
    if exact:
        return torch.equal(a, b)  # type: ignore[arg-type]
    tol = TOLERANCE[a.dtype]  # type: ignore[union-attr]
    return torch.allclose(a, b, rtol=tol, atol=tol)  # type: ignore[arg-type]


def _matches_ref(case: Case) -> bool:
    fused = case.fused()
    written = None if case.mutated is None else case.mutated.clone()
    same = _same(fused, case.ref(), case.exact)
    return same and (written is None or torch.equal(written, case.mutated))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=(1, 16, 64))
    p.add_argument("--hidden", type=int, nargs="+", default=sorted(MODELS), choices=MODELS)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if native.load_library() is None:
        raise SystemExit(f"native library unavailable: {native.load_error()}")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"{args.dtype}, {torch.get_num_threads()} threads, {kernels.__name__} ops vs refs")
    print(
        f"{'op':28s} {'rows':>4s} {'hidden':>6s} {'native us':>10s} {'ref us':>8s} {'speedup':>8s}"
    )
    with torch.inference_mode():
        for hidden in args.hidden:
            for rows in args.rows:
                for name, case in _cases(rows, hidden, dtype).items():
                    assert _matches_ref(case), f"{name} differs from its ref"
                    fused_us, ref_us = _us_per_call(case.fused), _us_per_call(case.ref)
                    print(
                        f"{name:28s} {rows:4d} {hidden:6d} {fused_us:10.1f} {ref_us:8.1f} "
                        f"{ref_us / fused_us:7.1f}x"
                    )


if __name__ == "__main__":
    main()
