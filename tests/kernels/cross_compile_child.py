"""The child process of the cross-compile tests: Triton imported with ``TRITON_INTERPRET`` unset
(the kernel tests' process has it set, and Triton reads it at import), kernels compiled for a
GPU target through ``kernels.cross_compile``; prints one JSON line for the parent to check.

    python -m tests.kernels.cross_compile_child compile '<json list of cases>'
    python -m tests.kernels.cross_compile_child workload '<json case>'
    python -m tests.kernels.cross_compile_child moe '<json list of cases>'

``compile``: per case (model, dtype, arch, max_model_len), :func:`kernels.warmup.warm_up` plus
``reshape_and_cache`` (a launcher with no engine call site), and every variant they launched.
``moe``: per case (arch, dtype), ``kernels.fused_moe`` at a MoE model's shape.
``workload``: warm_up, then a varied workload through the engine's own launch sites (the model's
forward over the step input buffers, graph-shaped and eager; the connector's block copies),
and the variants that workload compiled anew (there should be none).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

import kernels._common
from kernels.cross_compile import REFERENCE_SHAPES, CompileLog, Variant, compile_only, resources
from kernels.reshape_and_cache import reshape_and_cache
from kernels.warmup import ModelShape, warm_up

BLOCK_SIZE = 16
MAX_TOKENS = 8192  # max_num_batched_tokens: every prefill BLOCK_M is reachable


# Kernels whose register spills (ptxas -v, bytes stored per thread) the compile answer carries
# on sm_90: the attention tiles sized for it.
SPILL_CHECKED = ("_paged_prefill_attention_kernel", "_paged_decode_attention_kernel")  # sm_90
SPILL_CHECKED_EVERYWHERE = ("_sample_pick_kernel",)  # its search tile once spilled on sm_80


def _variants(log: CompileLog) -> list[dict[str, Any]]:
    return [
        {
            "kernel": v.kernel,
            "constants": {
                k: c if isinstance(c, int | str) else str(c) for k, c in v.constants.items()
            },
            "arch": v.compiled.metadata.target.arch,
            "cubin_bytes": len(v.compiled.asm["cubin"]),
            "warps": v.compiled.metadata.num_warps,
            "spill_stores": _spill_stores(v),
        }
        for v in log.launched.values()
    ]


def _spill_stores(variant: Variant) -> int | None:
    checked = variant.kernel in SPILL_CHECKED_EVERYWHERE or (
        variant.kernel in SPILL_CHECKED and variant.compiled.metadata.target.arch >= 90
    )
    return resources(variant).spill_stores if checked else None


def _limits(max_model_len: int) -> Any:
    from common.step_inputs import BatchLimits

    return BatchLimits(MAX_TOKENS, 256, -(-max_model_len // BLOCK_SIZE))


def _cache(shape: ModelShape, dtype: torch.dtype, num_layers: int = 2) -> torch.Tensor:
    size = (num_layers, 2, 64, BLOCK_SIZE, shape.num_kv_heads, shape.head_dim)
    return torch.zeros(size, dtype=dtype)


def _reshape_and_cache(shape: ModelShape, kv_layer: torch.Tensor) -> None:
    """K and V sliced out of a fused qkv row, as a layer that cached them separately would."""
    h, hkv, d = shape.num_heads, shape.num_kv_heads, shape.head_dim
    qkv = kv_layer.new_zeros(3, (h + 2 * hkv) * d)
    key = qkv[:, h * d : (h + hkv) * d].view(3, hkv, d)
    value = qkv[:, (h + hkv) * d :].view(3, hkv, d)
    reshape_and_cache(key, value, kv_layer, torch.full((3,), -1, dtype=torch.int64))


def compile_cases(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for case in cases:
        shape = REFERENCE_SHAPES[case["model"]]
        kv_cache = _cache(shape, getattr(torch, case["dtype"]))
        with compile_only(GPUTarget("cuda", case["arch"], 32)) as log:
            warm_up(shape, _limits(case["max_model_len"]), kv_cache)
            _reshape_and_cache(shape, kv_cache[0])
        results.append({**case, "variants": _variants(log)})
    return results


def compile_moe(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``kernels.fused_moe`` at Qwen3-30B-A3B's MoE shape (hidden 2048, 128 experts of 768,
    top 8) per (arch, dtype): the launcher's own calls, a decode-sized batch."""
    from kernels.fused_moe import fused_moe

    results = []
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        x = torch.zeros(4, 2048, dtype=dtype)
        gate_up = torch.zeros(128, 2 * 768, 2048, dtype=dtype)
        down = torch.zeros(128, 2048, 768, dtype=dtype)
        ids = torch.arange(32).view(4, 8)
        weights = torch.full((4, 8), 0.125, dtype=dtype)
        with compile_only(GPUTarget("cuda", case["arch"], 32)) as log:
            fused_moe(x, gate_up, down, weights, ids)
        results.append({**case, "variants": _variants(log)})
    return results


def restored(real_run: Any, active: Any) -> bool:
    """Whether compile_only put back what it replaced."""
    return (
        JITFunction.run is real_run
        and triton.runtime.driver._active is active
        and sys.modules["kernels.rms_norm"].check_runnable is kernels._common.check_runnable
    )


def run_child(command: str, payload: Any, triton_cache: Path, timeout: float) -> dict[str, Any]:
    """Parent side: run this module in a fresh interpreter with ``TRITON_INTERPRET`` unset and
    Triton's cache in ``triton_cache``; its JSON answer (a failure raises, with its stderr)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(triton_cache)
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", __name__, command, json.dumps(payload)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise AssertionError(f"{command} failed ({done.returncode}):\n{done.stderr[-6000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "run with TRITON_INTERPRET unset"
    command, payload = argv[1], json.loads(argv[2])
    real_run, active = JITFunction.run, triton.runtime.driver._active
    if command == "compile":
        out: dict[str, Any] = {"cases": compile_cases(payload)}
    elif command == "moe":
        out = {"cases": compile_moe(payload)}
    else:
        from tests.kernels.varied_workload import run_workload

        out = run_workload(payload)
    out["restored"] = restored(real_run, active)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv)
