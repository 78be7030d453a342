"""Every Triton kernel of ``kernels/`` compiles for real GPUs (sm_80, sm_90), without a GPU.

A child process (``cross_compile_child``: Triton imported with ``TRITON_INTERPRET`` unset)
drives the launchers through :func:`kernels.warmup.warm_up`, which launches each one as the
engine does (the model's fused ops, the attention backend's eager and graph-width block tables,
the connector's block copies, the LoRA shrink and expand of every projection), for
Llama-3.2-1B, Llama-3-8B and Qwen3-8B head sizes in bf16 and fp16 (adapters of rank 16),
through a stand-in driver that compiles every launch to a cubin and runs none. A variant
that stops compiling (Triton or ptxas) fails the test with the compiler's message, and so does
a variant set that differs from the one below: a specialisation split in two would compile
again mid-serving, a missing one would compile there for the first time.

The fast cases cover each target, each dtype, both head dims and the q/k norm; the slow ones
the rest of the matrix (about 15 s each on a cold cache).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kernels.cross_compile import REFERENCE_SHAPES
from tests.kernels.cross_compile_child import run_child

# (model, dtype, sm, max_model_len)
FAST = [
    ("Llama-3.2-1B", "bfloat16", 90, 2048),
    ("Qwen3-8B", "float16", 90, 8192),
    ("Llama-3-8B", "bfloat16", 80, 8192),
]
SLOW = [
    ("Llama-3.2-1B", "bfloat16", 80, 131072),
    ("Llama-3.2-1B", "float16", 80, 2048),
    ("Llama-3.2-1B", "float16", 90, 131072),
    ("Llama-3-8B", "bfloat16", 90, 8192),
    ("Llama-3-8B", "float16", 80, 8192),
    ("Llama-3-8B", "float16", 90, 8192),
    ("Qwen3-8B", "bfloat16", 80, 40960),
    ("Qwen3-8B", "bfloat16", 90, 40960),
    ("Qwen3-8B", "float16", 80, 8192),
]
# The constexprs that tell a kernel's variants apart within one engine (shape and dtype fixed).
BUCKETS = {
    "_rms_norm_kernel": ("HIDDEN", "HAS_RESIDUAL"),
    "_paged_prefill_attention_kernel": ("BLOCK_M",),
    "_paged_decode_attention_kernel": ("BLOCK_N",),
    "_paged_decode_reduce_kernel": ("BLOCK_N",),
    "_block_copy_kernel": ("TO_CACHE",),
    "_lora_kernel": ("EXPAND",),
}


def expected_variants(model: str, max_model_len: int) -> Counter[tuple[Any, ...]]:
    """What an engine of ``model`` launches, block 16, 8192 tokens per step (+ reshape_and_cache);
    ``max_model_len`` changes nothing: the decode split is not a constexpr."""
    shape = REFERENCE_SHAPES[model]
    rms = [(shape.hidden_size, False), (shape.hidden_size, True)]
    rms += [(shape.head_dim, False)] if shape.qk_norm else []
    variants = [("_rms_norm_kernel", *key) for key in rms]
    variants += [(name,) for name in ("_rotary_embedding_and_cache_kernel", "_silu_and_mul_kernel")]
    variants += [("_paged_prefill_attention_kernel", m) for m in (16, 32, 64, 128)]
    for kernel in ("_paged_decode_attention_kernel", "_paged_decode_reduce_kernel"):
        variants += [(kernel, block_n) for block_n in (16, 64)]
    variants += [("_block_copy_kernel", to_cache) for to_cache in (False, True)]
    variants += [("_reshape_and_cache_kernel",)]
    variants += [("_sample_tiles_kernel",), ("_sample_pick_kernel",)]
    if shape.lora_rank > 0:  # every projection's shrink, and expand into its column slices
        variants += [("_lora_kernel", expand) for expand in (False, True)]
    return Counter(variants)


def compiled_variants(result: dict[str, Any]) -> Counter[tuple[Any, ...]]:
    keys = []
    for v in result["variants"]:
        assert v["arch"] == result["arch"], v
        assert v["cubin_bytes"] > 0, v
        keys.append((v["kernel"], *(v["constants"][c] for c in BUCKETS.get(v["kernel"], ()))))
    return Counter(keys)


def _compile(cases: list[tuple[Any, ...]], cache: Path, timeout: float) -> dict[tuple, dict]:
    payload = [dict(zip(("model", "dtype", "arch", "max_model_len"), c)) for c in cases]
    answer = run_child("compile", payload, cache, timeout)
    assert answer["restored"], "compile_only left the fake driver or the patches in place"
    return {
        tuple(r[k] for k in ("model", "dtype", "arch", "max_model_len")): r for r in answer["cases"]
    }


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton-cache")


@pytest.fixture(scope="module")
def fast_results(triton_cache: Path) -> dict[tuple, dict]:
    return _compile(FAST, triton_cache, timeout=900)  # ~410 s at a load average of 8


@pytest.fixture(scope="module")
def slow_results(triton_cache: Path) -> dict[tuple, dict]:
    return _compile(SLOW, triton_cache, timeout=1200)


@pytest.mark.parametrize("case", FAST, ids=lambda c: f"{c[0]}-{c[1]}-sm{c[2]}")
def test_compiles_for_target(case: tuple[Any, ...], fast_results: dict[tuple, dict]) -> None:
    assert compiled_variants(fast_results[case]) == expected_variants(case[0], case[3])


@pytest.mark.parametrize("case", [c for c in FAST if c[2] == 90], ids=lambda c: c[0])
def test_attention_tiles_do_not_spill_on_sm90(
    case: tuple[Any, ...], fast_results: dict[tuple, dict]
) -> None:
    """The prefill kernel's 128-row tile runs 8 warps so that its fp32 accumulator fits."""
    checked = [
        v
        for v in fast_results[case]["variants"]
        if v["spill_stores"] is not None and v["kernel"] != "_sample_pick_kernel"
    ]
    assert {v["constants"].get("BLOCK_M") for v in checked} >= {16, 32, 64, 128}
    assert [v for v in checked if v["spill_stores"]] == []
    assert all(v["warps"] == 8 for v in checked if v["constants"].get("BLOCK_M") == 128)


@pytest.mark.parametrize("case", FAST, ids=lambda c: f"{c[0]}-{c[1]}-sm{c[2]}")
def test_the_sampler_pick_does_not_spill(
    case: tuple[Any, ...], fast_results: dict[tuple, dict]
) -> None:
    """Pass 2 holds a (SEARCH_TILE, PIVOTS) compare per chunk of its row search in registers:
    1024 rows of it spilled on sm_80 (64 registers, 120 bytes), 512 fit on both targets."""
    picks = [v for v in fast_results[case]["variants"] if v["kernel"] == "_sample_pick_kernel"]
    assert [v["spill_stores"] for v in picks] == [0]


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: f"{c[0]}-{c[1]}-sm{c[2]}")
def test_compiles_for_target_matrix(case: tuple[Any, ...], slow_results: dict[tuple, dict]) -> None:
    assert compiled_variants(slow_results[case]) == expected_variants(case[0], case[3])
