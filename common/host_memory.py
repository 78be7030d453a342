"""Host (CPU) memory for the engine: reuse of freed activations, huge pages for the KV cache.

A CPU forward pass allocates and frees the same multi-megabyte activations every step (a
2,048-token prefill chunk of even the tiny model makes 5.8 MB gate/up outputs). glibc serves
blocks above its mmap threshold with fresh ``mmap`` pages and unmaps them on ``free``, so every
step pays page faults and kernel zeroing for memory it just gave back; its adaptive threshold
settles only after a while, and a trimmed heap top faults again next step. Measured on the
throughput benchmark (2-core box): the first 64-request batch took 2.2 s untuned and 1.45 s
tuned, a 5x slower 2048x128x704 GEMM being the largest single loss.

:func:`keep_freed_host_memory` sets, once per process, glibc's mmap threshold to its ceiling
(32 MiB: larger blocks such as the KV cache still get their own mapping) and turns heap trimming
off, so freed activations stay in the heap and are reused without a fault. The cost is that the
process keeps its peak activation footprint. It is process-wide: an engine on the CPU calls it
(the serving processes run one engine each). Not glibc (musl, macOS): nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
import math

import torch

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
_TRIM_NEVER = 2**31 - 1  # mallopt takes an int
_TOP_PAD = 64 * 2**20  # grow the heap in 64 MiB steps

_done: bool | None = None


@functools.cache
def _libc_function(name: str):
    """``name`` from the C library (with errno), or None where there is no such function."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError, TypeError):
        return None


def keep_freed_host_memory() -> bool:
    """Tune glibc malloc as above; returns whether it applied (cached after the first call)."""
    global _done
    if _done is not None:
        return _done
    _done = False
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX),
            (_M_TRIM_THRESHOLD, _TRIM_NEVER),
            (_M_TOP_PAD, _TOP_PAD),
        )
    )
    if not _done:
        logger.debug("mallopt refused a setting: host allocator left as it is")
    return _done


_HUGE_PAGE = 2 * 2**20
_MADV_HUGEPAGE = 14


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose pages the kernel may back with 2 MiB transparent huge pages.

    The KV cache is read block by block from all over its range every decode step; with 4 KiB
    pages nearly every block is a TLB miss. Where THP is in ``madvise`` mode (the common
    default) memory only gets huge pages when asked, so this aligns the tensor to 2 MiB and
    calls ``madvise(MADV_HUGEPAGE)`` before the first touch. Without THP (or off Linux) it is a
    plain zeroed tensor.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % _HUGE_PAGE
    tensor = raw[offset : offset + nbytes].view(dtype).view(shape)
    madvise = _libc_function("madvise")
    if madvise is not None:
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if madvise(tensor.data_ptr(), nbytes, _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    return tensor.zero_()


def freeze_startup_objects() -> None:
    """Move everything alive now out of the cyclic garbage collector's reach, for good.

    A serving process builds its long-lived objects once (the model's modules and parameters,
    the tokenizer, the block pool's hundreds of thousands of blocks) and then allocates small
    ones every step; each full collection would walk the whole heap again mid-serving.
    ``gc.freeze`` puts what exists into a permanent generation that collections skip
    (reference counting still frees it). Call it once, after the engine is built, in a process
    that runs one engine for its life: a batch-256 decode step's host time went from 4.2–4.4 to
    3.5–4.1 ms (``python -m benchmarks.host_step --batches 64 256 [--freeze]``, three runs each,
    alternated). Not for a library user's process: what a closed engine leaves in reference
    cycles would stay forever. :func:`gc.unfreeze` at the end lets the exit collect it.
    """
    gc.collect()
    gc.freeze()
