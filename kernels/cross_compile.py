"""Compile the Triton kernels for a CUDA GPU on a machine without one (CI, a laptop).

Inside :func:`compile_only`, Triton's active driver is a stand-in whose current target is the
GPU asked for, and every ``kernel[grid](...)`` launch compiles its variant (Triton to PTX, ptxas
to a cubin) and returns without running. The launchers of ``kernels/`` accept CPU tensors of the
real shapes there, so the code that launches a kernel on a GPU can be driven as it is: what
compiles here compiles on the GPU (same Triton, same target, same options).

Triton must have been imported with ``TRITON_INTERPRET`` unset (it reads the variable at
import): under the interpreter there is nothing to compile.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import JITFunction

from kernels.warmup import ModelShape

SM80 = GPUTarget("cuda", 80, 32)  # A100
SM90 = GPUTarget("cuda", 90, 32)  # H100, H200

# The launchers whose device check (CUDA tensors, or the interpreter) is lifted inside.
LAUNCHER_MODULES = (
    "kernels.activation",
    "kernels.block_copy",
    "kernels.fused_moe",
    "kernels.lora",
    "kernels.paged_decode_attention",
    "kernels.paged_prefill_attention",
    "kernels.reshape_and_cache",
    "kernels.rms_norm",
    "kernels.rotary",
    "kernels.sampler",
)

# The model shapes CI compiles for: (q heads, kv heads, head_dim, hidden, intermediate, q/k norm,
# vocabulary, LoRA adapters of rank 16).
REFERENCE_SHAPES = {
    "Llama-3.2-1B": ModelShape(32, 8, 64, 2048, 8192, vocab_size=128256, lora_rank=16),
    "Llama-3-8B": ModelShape(32, 8, 128, 4096, 14336, vocab_size=128256, lora_rank=16),
    "Qwen3-8B": ModelShape(32, 8, 128, 4096, 12288, qk_norm=True, vocab_size=151936, lora_rank=16),
}


class _TargetDriver:
    """The parts of a Triton driver that compiling reads; its device is named by the target so
    that kernels compiled for two targets in one process never share a cache."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> str:
        return f"{self.target.backend}:sm_{self.target.arch}"

    def get_current_stream(self, device: object = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


class Variant(NamedTuple):
    """One compiled specialisation of a kernel."""

    kernel: str  # the @triton.jit function's name
    constants: dict[str, Any]  # its constexpr arguments, by name
    compiled: Any  # triton.compiler.CompiledKernel: .metadata, .asm["ptx" | "cubin"]


@dataclass
class CompileLog:
    """What happened inside one :func:`compile_only`: ``launches`` counts kernel launches,
    ``launched`` holds each variant they ran (by its hash), ``compiled`` the variants that were
    not in the process's kernel cache yet (compiled here, or read from Triton's cache dir)."""

    target: GPUTarget
    launches: int = 0
    launched: dict[str, Variant] = field(default_factory=dict)
    compiled: list[Variant] = field(default_factory=list)


def _constants(fn: JITFunction, compiled: Any) -> dict[str, Any]:
    names = fn.arg_names
    return {names[path[0]]: value for path, value in compiled.src.constants.items()}


@contextmanager
def compile_only(target: GPUTarget) -> Iterator[CompileLog]:
    """Inside: every launch compiles for ``target`` and runs nothing; the launchers take CPU
    tensors. On exit the real driver, ``JITFunction.run`` and the device checks are back."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_only needs TRITON_INTERPRET unset when triton is imported")
    log = CompileLog(target)
    driver = _TargetDriver(target)
    device = driver.get_current_device()
    real_run = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        cache = self.device_caches[device][0]
        before = len(cache)
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        variant = Variant(self.fn.__name__, _constants(self, kernel), kernel)
        log.launches += 1
        log.launched.setdefault(kernel.hash, variant)
        if len(cache) > before:
            log.compiled.append(variant)
        return kernel

    modules = [importlib.import_module(name) for name in LAUNCHER_MODULES]
    checks = [module.check_runnable for module in modules]
    # Restored as it was: reset_active() would create the real driver, which raises on a machine
    # without a GPU.
    previous = triton.runtime.driver._active
    triton.runtime.driver.set_active(driver)
    JITFunction.run = run  # type: ignore[method-assign]
    for module in modules:
        module.check_runnable = lambda kernel, device: None
    try:
        yield log
    finally:
        for module, check in zip(modules, checks, strict=True):
            module.check_runnable = check
        JITFunction.run = real_run  # type: ignore[method-assign]
        triton.runtime.driver._active = previous


class Resources(NamedTuple):
    """Per-thread registers, per-block shared memory, per-thread stack, and the registers
    spilled to local memory (bytes stored and loaded back per thread; 0 and 0: no spill)."""

    registers: int
    shared_bytes: int  # static (from the cubin) + dynamic (what Triton launches with)
    stack_bytes: int
    spill_stores: int
    spill_loads: int


def _nvidia_tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _cuobjdump_usage(cubin: bytes) -> dict[str, str]:
    """``REG``, ``SHARED``, ``STACK``, ``LOCAL``… of the cubin's kernel, by
    ``cuobjdump --dump-resource-usage`` (the one shipped in Triton's wheel)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        text = subprocess.run(
            [_nvidia_tool("cuobjdump"), "--dump-resource-usage", file.name],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    line = next(line for line in text.splitlines() if "REG:" in line)
    return dict(item.split(":", 1) for item in line.split() if ":" in item)


def _ptxas(arch: int) -> str:
    """The ptxas Triton assembles for ``arch`` with (3.9 ships a newer one for sm_90 and up)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:  # Triton before 3.8: one ptxas
        return _nvidia_tool("ptxas")
    return str(get_ptxas(arch).path)


def _ptxas_spills(variant: Variant) -> tuple[int, int]:
    """(spill stores, spill loads) in bytes: the PTX assembled again by ptxas with the flags
    Triton gave it (its ``-v`` report is not kept with the cubin)."""
    meta = variant.compiled.metadata
    arch = f"sm_{meta.target.arch}{'a' if meta.target.arch >= 90 else ''}"
    fmad = [] if meta.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(variant.compiled.asm["ptx"])
        command = [_ptxas(meta.target.arch), "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2"]
        command += [f"--gpu-name={arch}", str(ptx), "-o", str(Path(tmp) / "kernel.cubin")]
        log = subprocess.run(command, check=True, capture_output=True, text=True).stderr
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert found is not None, log
    return int(found.group(1)), int(found.group(2))


def resources(variant: Variant) -> Resources:
    """Resource usage of a compiled variant: its cubin read by cuobjdump, its spills by ptxas."""
    usage = _cuobjdump_usage(variant.compiled.asm["cubin"])
    return Resources(
        int(usage["REG"]),
        int(usage["SHARED"]) + int(variant.compiled.metadata.shared),
        int(usage["STACK"]),
        *_ptxas_spills(variant),
    )
