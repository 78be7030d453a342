"""Attention launch plans, before and after issue 25 (items 1 and 3), counted without a GPU.

Programs launched, programs with work, scratch written and K/V read per layer, from the plans
the launchers and the Triton backend execute (``kernels.paged_decode_attention.decode_plan``,
``common.attention_plan.step_launch``); "before" is the previous code's grid, written out here
(one prefill launch over every row of a mixed step; decode partitions of 512 tokens over the
block table's width, every one writing scratch). Per-step figures are x32 layers, bf16.

    python -m benchmarks.attention_launch_plan
"""

from __future__ import annotations

from typing import NamedTuple

from triton import cdiv, next_power_of_2

from common.attention import AttentionMetadata
from common.attention_plan import launch_stats, step_launch
from kernels.paged_decode_attention import decode_launch_stats, decode_plan

SMS, LAYERS, BYTES = 132, 32, 2  # H100/H200 SMs, Llama-3-8B layers, bf16
GB = 1e9


class Counts(NamedTuple):
    programs: int
    with_work: int
    decode_kv_bytes: int  # per layer
    scratch_bytes: int = 0  # per layer
    dead_scratch_bytes: int = 0  # per layer: written by programs with no key


def before_mixed(q_lens, seq_lens, heads, kv_heads, head_dim) -> Counts:
    """The old backend: the prefill kernel over all rows, BLOCK_M by the longest query."""
    block_m = min(max(next_power_of_2(max(q_lens)), 16), 64)
    programs = cdiv(max(q_lens), block_m) * len(q_lens) * heads
    with_work = sum(cdiv(q, block_m) for q in q_lens) * heads
    decode = sum(n for q, n in zip(q_lens, seq_lens, strict=True) if q == 1)
    return Counts(programs, with_work, 2 * decode * heads * head_dim * BYTES)


def after_mixed(q_lens, seq_lens, heads, kv_heads, head_dim, flash) -> Counts:
    meta = AttentionMetadata(None, None, None, None, q_lens, seq_lens, max(q_lens), 0)
    launch = step_launch(meta, heads, kv_heads, flash, SMS)
    s = launch_stats(launch, meta, heads, kv_heads, head_dim, BYTES)
    return Counts(s.programs, s.programs_with_work, s.decode_kv_bytes)


def before_decode(seq_lens, width, heads, kv_heads, head_dim) -> Counts:
    parts = cdiv(width, 512)
    programs = len(seq_lens) * kv_heads * parts
    with_keys = sum(cdiv(n, 512) for n in seq_lens) * kv_heads
    per_program = (heads // kv_heads) * (head_dim + 2) * 4
    scratch = programs * per_program if parts > 1 else 0
    dead = (programs - with_keys) * per_program if parts > 1 else 0
    return Counts(programs, with_keys, 0, scratch, dead)


def after_decode(seq_lens, width, heads, kv_heads, head_dim) -> Counts:
    plan = decode_plan(len(seq_lens), kv_heads, width, SMS)
    s = decode_launch_stats(seq_lens, heads, kv_heads, head_dim, BYTES, plan)
    return Counts(s.programs, s.programs_with_keys, 0, s.scratch_bytes, 0)


def _row(label: str, c: Counts) -> str:
    share = 100 * c.with_work / c.programs
    decode = f"{c.decode_kv_bytes * LAYERS / GB:.1f}" if c.decode_kv_bytes else "—"
    scratch = f"{c.scratch_bytes * LAYERS / GB:.4g} | {c.dead_scratch_bytes * LAYERS / GB:.4g}"
    return f"| {label} | {c.programs:,} | {c.with_work:,} ({share:.1f}%) | {decode} | {scratch} |"


def main() -> None:
    print("| case | programs / layer | with work | decode K/V GB / step | scratch GB / step "
          "| dead scratch GB / step |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    llama8b = (32, 8, 128)
    for cached, flash in ((0, False), (0, True), (2048, True)):
        q_lens, seq_lens = [1] * 200 + [1848], [1000] * 200 + [cached + 1848]
        kind = f"chunk after {cached}" if cached else "fresh chunk"
        where = "flash" if flash else "Triton"
        name = f"mixed 200 x 1000 + 1848 ({kind}, {where})"
        if not cached and not flash:
            print(_row(f"{name}, before", before_mixed(q_lens, seq_lens, *llama8b)))
        print(_row(f"{name}, after", after_mixed(q_lens, seq_lens, *llama8b, flash)))
    decodes = (
        ("decode 255 x 500 + one 128k", [500] * 255 + [131072], 131072, llama8b),
        ("decode graph 256 x 300, width 8192", [300] * 256, 8192, llama8b),
        ("decode Llama-3-70B TP 8, 1 x 4k", [4096], 4096, (8, 1, 128)),
    )
    for name, seq_lens, width, shape in decodes:
        print(_row(f"{name}, before", before_decode(seq_lens, width, *shape)))
        print(_row(f"{name}, after", after_decode(seq_lens, width, *shape)))


if __name__ == "__main__":
    main()
