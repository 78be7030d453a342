"""Registers, shared memory and spills of every Triton kernel variant an engine launches, per
GPU target, compiled without a GPU.

Each reference model shape (``kernels.cross_compile.REFERENCE_SHAPES``) is warmed as an engine
warms it (``kernels.warmup.warm_up``: block 16, 8192 tokens per step, ``--max-model-len``)
through the compile-only driver. Each variant's cubin is read by the ``cuobjdump
--dump-resource-usage`` shipped in Triton's wheel (registers per thread, shared memory per block:
static + what Triton launches with, stack per thread), and its PTX is assembled again by that
wheel's ``ptxas -v`` with Triton's flags (bytes of registers spilled per thread: stored / loaded
back). The default output is one line per kernel and target (the range over models, dtypes and
variants); ``--detail`` prints every variant.

    python -m benchmarks.kernel_resources
    python -m benchmarks.kernel_resources --targets 90 --models Llama-3-8B --detail

No GPU needed; ``TRITON_INTERPRET`` must be unset (there is nothing to compile under it).
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import NamedTuple

import torch
from triton.backends.compiler import GPUTarget

from kernels.cross_compile import REFERENCE_SHAPES, Resources, compile_only, resources
from kernels.warmup import ModelShape, warm_up

BLOCK_SIZE, MAX_TOKENS = 16, 8192
# the constexprs that tell one engine's variants of a kernel apart
BUCKETS = ("HAS_RESIDUAL", "HIDDEN", "BLOCK_M", "BLOCK_N", "TO_CACHE")


class Row(NamedTuple):
    target: int
    model: str
    dtype: str
    kernel: str
    variant: str
    warps: int
    usage: Resources


class _Limits(NamedTuple):
    max_tokens: int
    max_blocks_per_seq: int


def compile_rows(
    arch: int, model: str, shape: ModelShape, dtype: torch.dtype, max_model_len: int
) -> list[Row]:
    """Every variant an engine of ``shape`` launches, compiled for ``sm_<arch>``."""
    kv_cache = torch.zeros(2, 2, 64, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim, dtype=dtype)
    limits = _Limits(MAX_TOKENS, -(-max_model_len // BLOCK_SIZE))
    with compile_only(GPUTarget("cuda", arch, 32)) as log:
        warm_up(shape, limits, kv_cache)
    rows = []
    for v in log.launched.values():
        variant = " ".join(f"{k}={v.constants[k]}" for k in BUCKETS if k in v.constants)
        name = str(dtype).removeprefix("torch.")
        warps = int(v.compiled.metadata.num_warps)
        rows.append(Row(arch, model, name, v.kernel, variant, warps, resources(v)))
    return rows


def print_detail(rows: list[Row]) -> None:
    print("| sm | model | dtype | kernel | variant | warps | regs | shared (B) | stack | spills |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        u = r.usage
        print(
            f"| {r.target} | {r.model} | {r.dtype} | {r.kernel} | {r.variant} | {r.warps} "
            f"| {u.registers} | {u.shared_bytes} | {u.stack_bytes} | {_spills(u)} |"
        )


def _spills(usage: Resources) -> str:
    return f"{usage.spill_stores}/{usage.spill_loads}"


def _span(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}–{high}"


def print_summary(rows: list[Row]) -> None:
    groups: dict[tuple[int, str], list[Row]] = defaultdict(list)
    for r in rows:
        groups[(r.target, r.kernel)].append(r)
    print("| sm | kernel | variants | warps | regs | shared (B) | stack (B) | spills, most (B) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (target, kernel), group in sorted(groups.items()):
        usage = [r.usage for r in group]
        print(
            f"| {target} | {kernel} | {len(group)} | {_span([r.warps for r in group])} "
            f"| {_span([u.registers for u in usage])} | {_span([u.shared_bytes for u in usage])} "
            f"| {_span([u.stack_bytes for u in usage])} "
            f"| {_spills(max(usage, key=lambda u: u.spill_stores))} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--models", nargs="+", default=list(REFERENCE_SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--detail", action="store_true", help="one line per variant")
    args = parser.parse_args()
    rows = [
        row
        for arch in args.targets
        for model in args.models
        for dtype in args.dtypes
        for row in compile_rows(
            arch, model, REFERENCE_SHAPES[model], getattr(torch, dtype), args.max_model_len
        )
    ]
    (print_detail if args.detail else print_summary)(rows)


if __name__ == "__main__":
    main()
