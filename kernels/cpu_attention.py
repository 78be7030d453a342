"""Native CPU decode attention over the paged KV cache (``csrc/paged_attention_cpu.c``).

The C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``/``gcc``)
for the host CPU, into ``<cache root>/kernels/<key>/`` (``common.cache_dir``: built once, published
atomically, safe from several processes at once), and called through ``ctypes``. Building takes
about a second; the key hashes the source, the flags, the compiler and the CPU's feature flags,
so a cache shared between machines never hands one a library built for another's instruction
set.

No compiler, or a failed build: :func:`load_library` logs why once and returns ``None``, and the
engine keeps the plain PyTorch path (``attention_backend="torch"`` forces that path anyway).

The library links OpenMP (``-fopenmp``). PyTorch's CPU wheels load their own ``libgomp.so.1``
first, and the dynamic loader resolves ours to that same object, so the kernel and PyTorch
share one thread pool; the launcher passes ``torch.get_num_threads()`` explicitly.
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

import torch

from common.cache_dir import build_once, default_cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.c"
_LIB_NAME = "paged_attention_cpu.so"
# -ffast-math only when compiling (see the note at the top of the C file)
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
_LINK_FLAGS = ("-shared", "-fopenmp")
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_load_error: str | None = None


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_DTYPES)


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; ``None`` if it cannot be built."""
    global _library, _load_error
    with _lock:
        if _library is not None or _load_error is not None:
            return _library
        try:
            _library = _open(_build())
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            _load_error = str(exc)
            logger.warning("native CPU attention unavailable, using the PyTorch path: %s", exc)
        return _library


def load_error() -> str | None:
    """Why :func:`load_library` returned ``None`` (after it was called)."""
    return _load_error


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    partition_size: int = 0,
) -> torch.Tensor:
    """Attention of every sequence whose query length is 1 over its cached context.

    ``query``/``out`` ``(T, H, D)``, ``kv_layer`` ``(2, N, block_size, Hkv, D)``, ``block_tables``
    ``(S, max_blocks) int32``, ``seq_lens (S,) int32``, ``query_start_loc (S+1,) int32``; all on
    the CPU, contiguous, ``query``/``kv_layer``/``out`` of one dtype (float32 or bfloat16).
    Rows of sequences with a longer query are left as they are in ``out``. ``max_seq_len`` must
    bound ``seq_lens`` (it sizes the per-thread score buffer; a longer sequence is refused with
    ``ValueError``, never read past). Block ids are trusted: they come from the engine's own
    block tables. ``partition_size``: tokens per task when contexts are split so that a few
    sequences still keep every thread busy (0: chosen by the kernel; see the C source).
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError(f"native CPU attention unavailable: {_load_error}")
    num_tokens, num_heads, head_dim = query.shape
    two, num_blocks, block_size, num_kv_heads, kv_dim = kv_layer.shape
    num_seqs = seq_lens.shape[0]
    if two != 2 or kv_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit kv_layer {tuple(kv_layer.shape)}"
        )
    if query.dtype not in _DTYPES or kv_layer.dtype != query.dtype or out.dtype != query.dtype:
        raise ValueError(
            f"dtypes {query.dtype}/{kv_layer.dtype}/{out.dtype}: need one of {list(_DTYPES)}"
        )
    if out.shape != query.shape:
        raise ValueError(f"out {tuple(out.shape)} != query {tuple(query.shape)}")
    for name, t, dtype in (
        ("block_tables", block_tables, torch.int32),
        ("seq_lens", seq_lens, torch.int32),
        ("query_start_loc", query_start_loc, torch.int32),
    ):
        if t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} for {num_seqs} sequences")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc {tuple(query_start_loc.shape)} for {num_seqs} seqs")
    tensors = (query, kv_layer, block_tables, seq_lens, query_start_loc, out)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("all tensors must be contiguous CPU tensors")
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_seq_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the block tables' reach "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    failed = lib.pdserve_paged_decode(
        out.data_ptr(),
        query.data_ptr(),
        kv_layer.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        query_start_loc.data_ptr(),
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        num_blocks,
        block_tables.stride(0),
        max(int(max_seq_len), 1),
        float(scale),
        _DTYPES[query.dtype],
        max(int(partition_size), 0),
        torch.get_num_threads(),
    )
    if failed == 2:
        raise ValueError(f"a sequence in seq_lens is longer than max_seq_len {max_seq_len}")
    if failed:
        raise MemoryError("native CPU attention could not allocate its work buffers")
    return out


def _open(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    fn = lib.pdserve_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 8 + [ctypes.c_float] + [ctypes.c_int] * 3
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


def _build() -> Path:
    cc = _compiler()
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(_COMPILE_FLAGS + _LINK_FLAGS).encode(),
                cc.encode(),
                _cpu_flags().encode(),
                platform.machine().encode(),
            ]
        )
    ).hexdigest()[:16]

    def compile_into(out: Path) -> None:
        obj = out / "paged_attention_cpu.o"
        for cmd in (
            [cc, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
            [cc, *_LINK_FLAGS, str(obj), "-o", str(out / _LIB_NAME), "-lm"],
        ):
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
        obj.unlink()

    target = default_cache_root() / "kernels" / key
    return build_once(target, compile_into, lambda d: (d / _LIB_NAME).is_file()) / _LIB_NAME
