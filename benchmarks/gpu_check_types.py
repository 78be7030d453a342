"""What ``benchmarks/gpu_check.py`` and its sections share: a table row, the run's sizes, the
run's context, a section."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch


@dataclass
class Row:
    """One line of the table. ``status``: pass, fail, info, or skip (not run: budget)."""

    name: str
    measured: str
    goal: str
    status: str
    correctness: bool
    values: dict[str, Any] = field(default_factory=dict)  # the figures behind ``measured``
    section: str = ""  # the section that gave it (set by the runner)

    @staticmethod
    def check(name: str, ok: bool, measured: str, goal: str, **values: Any) -> Row:
        return Row(name, measured, goal, "pass" if ok else "fail", True, values)

    @staticmethod
    def perf(name: str, ok: bool | None, measured: str, goal: str, **values: Any) -> Row:
        """``ok=None``: no goal applies here (info)."""
        status = "info" if ok is None else "pass" if ok else "fail"
        return Row(name, measured, goal, status, False, values)


@dataclass(frozen=True)
class Profile:
    """The sizes one run uses: ``FULL`` on a GPU, ``QUICK`` on CPU or with ``--quick``."""

    shape: str  # common/models/shapes.py
    layers: int | None  # override of the shape's depth
    dtype: str
    kernel_tests: tuple[str, ...]
    engine_tests: tuple[str, ...]  # with graphs and overlap (the CUDA defaults)
    eager_tests: tuple[str, ...]  # the same without (on a GPU, a subset: each engine takes ~12 s)
    eager_graph: tuple[int, int]  # prompts, tokens each
    prefill: tuple[int, int, int, int, int]  # sequences, tokens each, heads, kv heads, head dim
    batches: tuple[int, int]  # decode batch sizes timed; the larger one is profiled
    decode_context: int
    decode_steps: int
    throughput: tuple[int, tuple[int, int], tuple[int, int], int]  # n, inputs, outputs, HF batch
    kv_shape: str
    kv_prompts: tuple[tuple[int, int], ...]
    test_caps_s: tuple[int, int, int]  # kernel tests, HF equivalence on, off


FULL = Profile(
    shape="llama-3.2-1b",
    layers=None,
    dtype="bfloat16",
    kernel_tests=(
        "tests/kernels",
        "--ignore=tests/kernels/test_compile_targets.py",  # CPU CI compiles for sm_80/sm_90
        "--ignore=tests/kernels/test_cpu_attention.py",  # the native CPU kernels
        "--ignore=tests/kernels/test_fused_ops_cpu.py",
    ),
    engine_tests=("tests/engine/test_hf_equivalence.py", "tests/engine/test_overlap.py"),
    eager_tests=("tests/engine/test_hf_equivalence.py", "-k", "default or chunked"),
    eager_graph=(32, 48),
    prefill=(4, 2048, 32, 8, 64),
    batches=(1, 64),
    decode_context=512,
    decode_steps=32,
    throughput=(64, (100, 1024), (100, 256), 32),
    kv_shape="llama-3.2-1b",
    kv_prompts=((8, 2048),),
    test_caps_s=(150, 150, 45),
)
QUICK = Profile(
    shape="cpu-kv32k",
    layers=2,
    dtype="float32",
    kernel_tests=("tests/kernels/test_paged_decode_attention.py", "-k", "bs16-d64 or padded"),
    engine_tests=("tests/engine/test_hf_equivalence.py", "-k", "tiny-llama and default"),
    eager_tests=("tests/engine/test_hf_equivalence.py", "-k", "tiny-llama and default"),
    eager_graph=(4, 8),
    prefill=(1, 32, 2, 1, 16),
    batches=(1, 8),
    decode_context=32,
    decode_steps=4,
    throughput=(4, (4, 16), (2, 6), 2),
    kv_shape="cpu-kv32k",
    kv_prompts=((2, 64),),
    test_caps_s=(240, 300, 300),
)


@dataclass
class Context:
    """What the sections share: the run's settings, its deadline, and the objects built once
    (the dummy-shape ``LLM``, the decode step times) under ``shared``."""

    args: argparse.Namespace
    device: torch.device
    profile: Profile
    deadline: float
    work_dir: Path
    shared: dict[str, Any] = field(default_factory=dict)

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class Section(NamedTuple):
    name: str
    run: Callable[[Context], list[Row]]
    correctness: bool  # an error here is a failed correctness row
    min_s: float  # skipped when less than this is left of the budget
