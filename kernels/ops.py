"""The fused ops of a Llama-family decoder layer as PyTorch ops: ``torch.ops.pdserve.*``.

A decode step of a small model is bound by launches, not bytes, so each op is one dispatched
call that runs one kernel: a Triton launch on CUDA, one native call on the CPU (the library of
``kernels.native``; where it cannot be built, and for float16, the op runs its ``ref_*``).

- ``rms_norm``, ``fused_add_rms_norm``: ``kernels/rms_norm.py``
- ``silu_and_mul``: ``kernels/activation.py``
- ``rotary_embedding_and_cache`` (mutates ``kv_cache_layer``): ``kernels/rotary.py``
- ``paged_decode_attention_cpu`` (CPU only): ``kernels/cpu_attention.py``
- ``sample_tokens`` (mutates ``counts``; two Triton launches on CUDA): ``kernels/sampler.py``
- ``moe_decode`` (CPU only: a MoE MLP's decode step; CUDA runs ``kernels/fused_moe.py``):
  ``kernels/moe_cpu.py``

Each module's ``<op>`` is the CUDA impl (Triton), ``<op>_cpu`` the CPU one (native), and its
docstrings hold the contract (shapes, dtypes, what is mutated). The ops are registered with
``torch.library.Library`` ``define`` + ``impl``: ~2.4 µs of dispatch per call, against ~9 µs
through ``torch.library.custom_op``. Fake impls give shapes to meta tensors (``FakeTensorMode``,
``torch.compile``). Importing this module registers the ops once per process: importing it
again (``importlib.reload``, a second module name) keeps the first registration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kernels import cpu_attention
from kernels.activation import silu_and_mul, silu_and_mul_cpu
from kernels.moe_cpu import moe_decode_cpu
from kernels.rms_norm import fused_add_rms_norm, fused_add_rms_norm_cpu, rms_norm, rms_norm_cpu
from kernels.rotary import rotary_embedding_and_cache, rotary_embedding_and_cache_cpu
from kernels.sampler import sample_tokens, sample_tokens_cpu

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "fused_add_rms_norm": (
        "fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) "
        "-> (Tensor out, Tensor residual_out)"
    ),
    "silu_and_mul": "silu_and_mul(Tensor x) -> Tensor",
    "rotary_embedding_and_cache": (
        "rotary_embedding_and_cache(Tensor qkv, Tensor positions, Tensor cos_sin_cache, "
        "Tensor(a!) kv_cache_layer, Tensor slot_mapping, int num_heads, int num_kv_heads) "
        "-> Tensor"
    ),
    "paged_decode_attention_cpu": (
        "paged_decode_attention_cpu(Tensor query, Tensor kv_cache_layer, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, int max_seq_len, float scale) -> Tensor"
    ),
    "sample_tokens": "sample_tokens(Tensor logits, Tensor params, Tensor(a!) counts) -> Tensor",
    "moe_decode": (
        "moe_decode(Tensor x, Tensor router, Tensor gate_up, Tensor down, int top_k, "
        "bool renormalize, bool fp32_weights) -> Tensor"
    ),
}


_IMPLS = {  # op -> (CPU, CUDA)
    "rms_norm": (rms_norm_cpu, rms_norm),
    "fused_add_rms_norm": (fused_add_rms_norm_cpu, fused_add_rms_norm),
    "silu_and_mul": (silu_and_mul_cpu, silu_and_mul),
    "rotary_embedding_and_cache": (rotary_embedding_and_cache_cpu, rotary_embedding_and_cache),
    # out=None: a new output, the rows of sequences whose query length is not 1 unwritten
    "paged_decode_attention_cpu": (cpu_attention.paged_decode_attention, None),
    "sample_tokens": (sample_tokens_cpu, sample_tokens),
    "moe_decode": (moe_decode_cpu, None),
}


def _rows_like(x: torch.Tensor, width: int) -> torch.Tensor:
    return x.new_empty((x.shape[0], width))


_FAKES: dict[str, Callable[..., Any]] = {  # the output shapes, for meta tensors
    "rms_norm": lambda x, weight, eps: _rows_like(x, x.shape[1]),
    "fused_add_rms_norm": lambda x, residual, weight, eps: (
        _rows_like(x, x.shape[1]),
        _rows_like(x, x.shape[1]),
    ),
    "silu_and_mul": lambda x: _rows_like(x, x.shape[1] // 2),
    "rotary_embedding_and_cache": lambda qkv, positions, cos_sin_cache, kv, slots, heads, _: (
        qkv.new_empty((qkv.shape[0], heads, kv.shape[-1]))
    ),
    "paged_decode_attention_cpu": lambda query, *_: torch.empty_like(query),
    "sample_tokens": lambda logits, *_: logits.new_empty(logits.shape[0], dtype=torch.int64),
    "moe_decode": lambda x, router, gate_up, down, *_: _rows_like(x, gate_up.shape[2]),
}


def _register() -> torch.library.Library:
    library = torch.library.Library("pdserve", "DEF")
    for name, schema in SCHEMAS.items():
        library.define(schema)
        cpu, cuda = _IMPLS[name]
        library.impl(name, cpu, "CPU")
        if cuda is not None:
            library.impl(name, cuda, "CUDA")
        torch.library.register_fake(f"pdserve::{name}", _FAKES[name], lib=library)
    return library


# The registrations live as long as this Library object: a second import must not replace it.
if not hasattr(torch.ops.pdserve, "rms_norm"):
    _LIBRARY = _register()
