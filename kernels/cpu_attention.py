"""Native CPU decode attention over the paged KV cache (``csrc/paged_attention_cpu.c``).

The kernel lives in the native library of ``kernels.native`` (C, compiled on first use into the
cache directory, called through ``ctypes``). No compiler, or a failed build: :func:`load_library`
returns ``None`` (the reason is logged once and kept in :func:`load_error`), and the engine keeps
the plain PyTorch path (``attention_backend="torch"`` forces that path anyway).
"""

from __future__ import annotations

import ctypes
from typing import NoReturn

import torch

from kernels import native

_DTYPES = native.DTYPE_CODES
_CACHE_DTYPES = native.CACHE_DTYPE_CODES
_FP8_KV_DTYPE = torch.float8_e4m3fn  # the one KV cache dtype other than the query's


def supported_dtypes() -> tuple[torch.dtype, ...]:
    return tuple(_DTYPES)


def load_library() -> ctypes.CDLL | None:
    """The native library, building it on first use; ``None`` if it cannot be built."""
    return native.load_library()


def load_error() -> str | None:
    """Why :func:`load_library` returned ``None`` (after it was called)."""
    return native.load_error()


def paged_decode_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    partition_size: int = 0,
) -> torch.Tensor:
    """Attention of every sequence whose query length is 1 over its cached context.

    ``query``/``out`` ``(T, H, D)``, ``kv_layer`` ``(2, N, block_size, Hkv, D)``, ``block_tables``
    ``(S, max_blocks) int32``, ``seq_lens (S,) int32``, ``query_start_loc (S+1,) int32``; all on
    the CPU, contiguous, ``query``/``out`` of one dtype (float32 or bfloat16), ``kv_layer`` of
    that dtype or ``float8_e4m3fn`` (read exactly: the result equals that over
    ``kv_layer.to(query.dtype)``, bit for bit).
    Rows of sequences with a longer query are left as they are in ``out`` (``None``: a new
    tensor, those rows uninitialised; this is the op ``paged_decode_attention_cpu``).
    ``max_seq_len`` must bound ``seq_lens`` (it sizes the per-thread score buffer; a longer
    sequence is refused with ``ValueError``, never read past). Block ids are trusted: they come
    from the engine's own block tables. ``partition_size``: tokens per task when contexts are
    split so that a few sequences still keep every thread busy (0: chosen by the kernel; see the
    C source). Returns ``out``.
    """
    lib = load_library()
    if lib is None:
        raise RuntimeError(f"native CPU attention unavailable: {native.load_error()}")
    _check_args((query, kv_layer, block_tables, seq_lens, query_start_loc, out))
    if out is None:
        out = torch.empty_like(query)
    num_tokens, num_heads, head_dim = query.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_layer.shape
    num_seqs, max_blocks = block_tables.shape
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_seq_len > max_blocks * block_size:
        raise ValueError(
            f"max_seq_len {max_seq_len} exceeds the block tables' reach "
            f"({max_blocks} blocks of {block_size})"
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
        max_blocks,  # the row stride of the contiguous block_tables
        max(int(max_seq_len), 1),
        scale,
        _DTYPES[query.dtype],
        _CACHE_DTYPES[kv_layer.dtype],
        max(int(partition_size), 0),
        torch.get_num_threads(),
    )
    if failed == 2:
        raise ValueError(f"a sequence in seq_lens is longer than max_seq_len {max_seq_len}")
    if failed:
        raise MemoryError("native CPU attention could not allocate its work buffers")
    return out


# (query, kv_layer, block_tables, seq_lens, query_start_loc, out): the tensors of a call, as
# the checks take them
_Args = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None
]


def _check_args(args: _Args) -> None:
    """A valid call (once per layer per step) is vetted by one cheap expression; ``_explain``
    says what is wrong with another."""
    query, kv_layer, block_tables, seq_lens, query_start_loc, out = args
    if query.dim() == 3 and kv_layer.dim() == 5 and block_tables.dim() == 2:  # shapes to read
        _, num_heads, head_dim = query.shape
        two, _, _, num_kv_heads, kv_dim = kv_layer.shape
        num_seqs = block_tables.shape[0]
        dtype = query.dtype
        ok = (
            two == 2
            and kv_dim == head_dim
            and num_kv_heads > 0
            and num_heads % num_kv_heads == 0
            and dtype in _DTYPES
            and (kv_layer.dtype == dtype or kv_layer.dtype == _FP8_KV_DTYPE)
            and block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
            and seq_lens.shape == (num_seqs,)
            and query_start_loc.shape == (num_seqs + 1,)
            and query.is_contiguous()
            and kv_layer.is_contiguous()
            and block_tables.is_contiguous()
            and seq_lens.is_contiguous()
            and query_start_loc.is_contiguous()
            and query.is_cpu
            and kv_layer.is_cpu
            and block_tables.is_cpu
            and seq_lens.is_cpu
            and query_start_loc.is_cpu
            and (
                out is None
                or (
                    out.shape == query.shape
                    and out.dtype == dtype
                    and out.is_contiguous()
                    and out.is_cpu
                )
            )
        )
        if ok:
            return
    _explain(args)


def _explain(args: _Args) -> NoReturn:
    query, kv_layer, block_tables, seq_lens, query_start_loc, out = args
    _, num_heads, head_dim = query.shape
    two, _, _, num_kv_heads, kv_dim = kv_layer.shape
    num_seqs = seq_lens.shape[0]
    if two != 2 or kv_dim != head_dim or num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"query {tuple(query.shape)} does not fit kv_layer {tuple(kv_layer.shape)}"
        )
    out = query if out is None else out  # None: a new tensor like query
    if query.dtype not in _DTYPES or out.dtype != query.dtype:
        raise ValueError(
            f"query/out dtypes {query.dtype}/{out.dtype}: need one of {list(_DTYPES)}, both the same"
        )
    if kv_layer.dtype not in (query.dtype, _FP8_KV_DTYPE):
        raise ValueError(
            f"dtypes {query.dtype}/{kv_layer.dtype}: a kv_layer for {query.dtype} queries must "
            f"be {query.dtype} or {_FP8_KV_DTYPE}"
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
    raise ValueError(f"seq_lens must have shape ({num_seqs},), got {tuple(seq_lens.shape)}")
