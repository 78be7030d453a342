"""The native CPU kernels: the C sources of ``csrc/`` built on first use into one library.

``paged_attention_cpu.c`` (decode attention over the paged cache), ``fused_ops_cpu.c``
(RMSNorm, SiLU-and-mul, RoPE + cache write), ``sampler_cpu.c`` (token sampling) and
``moe_cpu.c`` (a MoE MLP's decode step); all but the sampler share the element types of
``bf16.h`` (float32, bfloat16, and float8_e4m3fn for the KV cache). They are compiled with the machine's C compiler (``$CC``, else ``cc``/``gcc``/``clang``) for the host CPU,
each with its own flags, and linked into one shared library in ``<cache root>/kernels/<key>/``
(``common.native_build``: built once, published atomically, safe from several processes at once).
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
import logging
import subprocess
import threading
from pathlib import Path

import torch

from common import native_build
from common.native_build import Source

logger = logging.getLogger(__name__)

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
    # the sampler: libm's expf/logf and sums in index order (no -ffast-math)
    Source(_CSRC / "sampler_cpu.c", (*_COMMON_FLAGS, "-ffp-contract=off")),
    # a MoE MLP's decode step: its dot products vectorised (agrees to reassociation)
    Source(_CSRC / "moe_cpu.c", (*_COMMON_FLAGS, "-ffast-math")),
)
# What the sources `#include "..."`: found through `-I csrc`, hashed into the cache key.
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIB_NAME = "pdserve_cpu.so"

# The dtypes the kernels take (the model's: activations, queries, outputs), as the `dtype`
# code each C function receives.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
# The KV cache dtypes of the decode and rotary kernels, as their `cache_dtype` code: the model
# dtype, or float8_e4m3fn with either (bf16.h).
CACHE_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}

_PTR, _INT, _I64, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
# C function -> argument types; every one returns an int status (0 = done).
_PROTOTYPES = {
    "pdserve_paged_decode": [_PTR] * 6 + [_INT] * 8 + [_FLOAT] + [_INT] * 4,
    "pdserve_rms_norm": [_PTR] * 5 + [_I64] * 4 + [_FLOAT, _INT, _INT],
    "pdserve_silu_and_mul": [_PTR] * 2 + [_I64] * 3 + [_INT, _INT],
    "pdserve_rotary_embedding_and_cache": [_PTR] * 6
    + [_I64]
    + [_INT] * 4
    + [_I64] * 5
    + [_INT] * 3,
    "pdserve_sample_tokens": [_PTR] * 4 + [_I64] * 3 + [_INT],
    "pdserve_moe_decode": [_PTR] * 5 + [_I64] * 4 + [_INT] * 5,
    # float8_e4m3fn <-> float32 over n elements, as the kernels convert (for the tests)
    "pdserve_f32_to_e4m3": [_PTR, _PTR, _I64],
    "pdserve_e4m3_to_f32": [_PTR, _PTR, _I64],
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


_compiler = native_build.compiler


def _library_spec() -> native_build.NativeLibrary:
    """What to build, from SOURCES and HEADERS as they are now."""
    return native_build.NativeLibrary(
        name=_LIB_NAME, cache_subdir="kernels", sources=SOURCES, include_dir=_CSRC,
        headers=HEADERS, link_flags=_LINK_FLAGS, libs=("-lm",),
    )  # fmt: skip


def _cache_key(cc: str) -> str:
    return native_build.cache_key(_library_spec(), cc)


def _build() -> Path:
    return native_build.build(_library_spec(), _compiler())
