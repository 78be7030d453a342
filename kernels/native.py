"""The native CPU kernels: the C sources of ``csrc/`` built on first use into one library.

``paged_attention_cpu.c`` (decode attention over the paged cache) and ``fused_ops_cpu.c``
(RMSNorm, SiLU-and-mul, RoPE + cache write) share the element types of ``bf16.h``; they are
compiled with the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for the host CPU,
each with its own flags, and linked into one shared library in ``<cache root>/kernels/<key>/``
(``common.cache_dir``: built once, published atomically, safe from several processes at once).
Building takes about two seconds; the key hashes the sources and headers, the flags, the
compiler and the CPU's feature flags, so a cache shared between machines never hands one a
library built for another's instruction set.

The library is called through ``ctypes``, which releases the GIL for the duration of a call. No
compiler, or a failed build: :func:`load_library` logs why once and returns ``None``, and every
caller keeps its plain PyTorch path.

The library links OpenMP (``-fopenmp``). PyTorch's CPU wheels load their own ``libgomp.so.1``
first, and the dynamic loader resolves ours to that same object, so the kernels and PyTorch
share one thread pool; the launchers pass ``torch.get_num_threads()`` explicitly.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from common.cache_dir import build_once, default_cache_root

logger = logging.getLogger(__name__)


class Source(NamedTuple):
    path: Path
    flags: tuple[str, ...]


_CSRC = Path(__file__).with_name("csrc")
_COMMON_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-std=c11")
SOURCES = (
    # -ffast-math only when compiling (see the note at the top of the C file)
    Source(_CSRC / "paged_attention_cpu.c", (*_COMMON_FLAGS, "-ffast-math")),
    # bit-exact with PyTorch: no FMA contraction, no reassociation; the other two flags change
    # no value (errno, FP exception flags) but let loops with sqrtf/rintf/selects vectorise
    Source(
        _CSRC / "fused_ops_cpu.c",
        (*_COMMON_FLAGS, "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"),
    ),
)
# What the sources `#include "..."`: found through `-I csrc`, hashed into the cache key.
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIB_NAME = "pdserve_cpu.so"

# The dtypes the kernels take, as the `dtype` code each C function receives.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}

_PTR, _INT, _I64, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# C function -> argument types; every one returns an int status (0 = done).
_PROTOTYPES = {
    "pdserve_paged_decode": [_PTR] * 6 + [_INT] * 8 + [_FLOAT] + [_INT] * 3,
    "pdserve_rms_norm": [_PTR] * 5 + [_I64] * 4 + [_FLOAT, _INT, _INT],
    "pdserve_silu_and_mul": [_PTR] * 2 + [_I64] * 3 + [_INT, _INT],
    "pdserve_rotary_embedding_and_cache": [_PTR] * 6
    + [_I64]
    + [_INT] * 4
    + [_I64] * 5
    + [_INT, _INT],
}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; ``None`` if it cannot be built."""
    global _library, _load_error
    if _library is not None:  # the per-call path: no lock
        return _library
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        try:
            _library = _open(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            _load_error = str(exc)
            logger.warning("native CPU kernels unavailable, using the PyTorch paths: %s", exc)
        return _library


def load_error() -> str | None:
    """Why :func:`load_library` returned ``None`` (after it was called)."""
    return _load_error


def library_for(dtype: torch.dtype) -> ctypes.CDLL | None:
    """The library when its kernels take ``dtype``, else ``None`` (the caller's ref path)."""
    return load_library() if dtype in DTYPE_CODES else None


def check_cpu(tensor: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``tensor`` is on the CPU (the message is built only then)."""
    if not tensor.is_cpu:
        raise ValueError(f"the native kernels need CPU tensors, got {tensor.device}")


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    for name, argtypes in _PROTOTYPES.items():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = argtypes
    return lib


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise RuntimeError("no C compiler found (set $CC, or install gcc)")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _cache_key(cc: str) -> str:
    parts = [cc, " ".join(_LINK_FLAGS), _cpu_flags(), platform.machine()]
    for source in SOURCES:
        parts += [source.path.read_text(), " ".join(source.flags)]
    parts += [header.read_text() for header in HEADERS]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _build() -> Path:
    cc = _compiler()

    def compile_into(out: Path) -> None:
        objects = [out / source.path.with_suffix(".o").name for source in SOURCES]
        commands = [
            [cc, *source.flags, "-I", str(_CSRC), "-c", str(source.path), "-o", str(obj)]
            for source, obj in zip(SOURCES, objects, strict=True)
        ]
        commands.append([cc, *_LINK_FLAGS, *map(str, objects), "-o", str(out / _LIB_NAME), "-lm"])
        for cmd in commands:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        for obj in objects:
            obj.unlink()

    target = default_cache_root() / "kernels" / _cache_key(cc)
    return build_once(target, compile_into, lambda d: (d / _LIB_NAME).is_file()) / _LIB_NAME
