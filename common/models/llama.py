"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over the paged KV cache; Mixtral and
Qwen3-MoE are the same decoder with the sparse MLP of ``common/models/moe.py`` in its layers.

Plain single-device PyTorch around a few fused ops (``kernels/ops.py``: Triton on CUDA, native
C on CPU, one dispatched op each). A decoder layer is ten ops:

    fused_add_rms_norm → qkv_proj → rotary_embedding_and_cache (q rotated; k, v into the cache)
    → attention → o_proj → fused_add_rms_norm → gate_up_proj → silu_and_mul → down_proj

Qwen3 adds an RMSNorm of every q and k head over ``head_dim`` before RoPE (``q_norm``, ``k_norm``:
the same ``rms_norm`` op with heads as rows): five more kernels per layer (two copies of the head
rows, two norms, one concatenation back into q|k|v for the rotary op).

Projections are fused (q|k|v, gate|up); the loader splits HF checkpoints into them. Under tensor
parallelism (``tp``, ``common/parallel/``) each rank builds the same model over its heads and
intermediate rows, with o_proj and down_proj row-parallel (one all-reduce each), a
vocab-parallel embedding and LM head; ``tp=None`` is the single-device model, op for op. The residual
stream travels beside the hidden states so its add happens inside the next norm. Numerics follow
HF transformers step for step (fp32 inside RMSNorm, the model dtype between ops, the same
rounding points in RoPE and SiLU), so greedy outputs match token for token; the model stays in
its dtype, with no per-layer casts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.attention import AttentionBackend, AttentionMetadata
from common.lora.batch import LoraBatch
from common.models.fp8 import FP8, checkpoint_quantization, projection
from common.models.moe import MoeArgs, SparseMoe
from common.models.preflight import architecture
from common.parallel.group import TensorParallel
from common.parallel.layers import ParallelLMHead, VocabParallelEmbedding
from kernels import ops as _registered  # noqa: F401 - registers torch.ops.pdserve.*

_ops = torch.ops.pdserve


@dataclass(frozen=True)
class LlamaArgs:
    """The parts of an HF ``config.json`` this model reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    qkv_bias: bool
    o_bias: bool  # Llama/Qwen3 ``attention_bias`` puts a bias on o_proj too; Qwen2 has none there
    qk_norm: bool  # Qwen3: RMSNorm of each q and k head before RoPE
    tie_word_embeddings: bool
    moe: MoeArgs | None = None  # Mixtral, Qwen3-MoE: the sparse MLP (``common/models/moe.py``)
    fp8: bool = False  # an FP8 checkpoint: the projections are ``Fp8Linear`` (common/models/fp8)

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> LlamaArgs:
        arch = architecture(cfg)
        heads = cfg["num_attention_heads"]
        theta, scaling = _rope_settings(cfg)
        return LlamaArgs(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            o_bias=arch != "Qwen2ForCausalLM" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            moe=MoeArgs.from_hf(cfg, arch),
            fp8=checkpoint_quantization(cfg) == "fp8",
        )


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from transformers 4 keys or transformers 5's ``rope_parameters``."""
    params = cfg.get("rope_parameters") or {}
    theta = float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    return theta, scaling


class RMSNorm(nn.Module):
    """``forward(x)`` → norm(x); ``forward(x, residual)`` → (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return _ops.rms_norm(x, self.weight, self.eps)
        return _ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``(head_dim // 2,)`` in fp32, with linear or llama3 scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]  # type: ignore[index]
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)  # type: ignore[arg-type]
    raise ValueError(f"unsupported rope_scaling type {kind!r} (default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are stretched by ``factor``, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE table ``cos_sin_cache (max_pos, D)``: ``[:, :D/2]`` = cos, ``[:, D/2:]``
    = sin of position x inverse frequency, computed in fp32 and cast to the model's dtype with
    the model (the values HF's ``cos.to(x.dtype)`` gives)."""

    cos_sin_cache: torch.Tensor

    def __init__(self, args: LlamaArgs, max_positions: int) -> None:
        super().__init__()
        self.args, self.max_positions = args, max_positions
        self.register_buffer("cos_sin_cache", self._table(torch.float32), False)

    def fill(self, dtype: torch.dtype) -> None:
        """Recompute the table on the current default device in ``dtype`` (after the module
        was built on ``meta`` and given storage, the buffer holds no values)."""
        self.cos_sin_cache = self._table(dtype)

    def _table(self, dtype: torch.dtype) -> torch.Tensor:
        a = self.args
        inv_freq = rope_inv_freq(a.head_dim, a.rope_theta, a.rope_scaling)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        return torch.cat((freqs.cos(), freqs.sin()), -1).to(dtype)  # (max_pos, D)


def local_heads(args: LlamaArgs, tp: TensorParallel | None) -> tuple[int, int]:
    """(query heads, KV heads) one rank holds."""
    if tp is None:
        return args.num_heads, args.num_kv_heads
    begin, end = tp.kv_head_range(args.num_kv_heads)
    return args.num_heads // tp.size, end - begin


class Attention(nn.Module):
    def __init__(
        self, args: LlamaArgs, layer: int, backend: AttentionBackend, tp: TensorParallel | None
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = local_heads(args, tp)
        self.head_dim = args.head_dim
        self.q_size = self.num_heads * args.head_dim
        self.kv_size = self.num_kv_heads * args.head_dim
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_proj = projection(args.hidden_size, qkv, args.qkv_bias, args.fp8)
        self.o_proj = projection(self.q_size, args.hidden_size, args.o_bias, args.fp8, tp)
        self.scale = args.head_dim**-0.5
        # an FP8 KV cache holds K / k_scale and V / v_scale (the checkpoint's ``k_scale`` and
        # ``v_scale``, else 1, as vLLM): k_scale joins the softmax scale, v_scale the output
        self.k_scale = self.v_scale = 1.0
        self.backend = backend
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps)
        self.qk_norm = args.qk_norm

    def forward(self, positions, x, rotary, kv_layer, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) D)
        lora = meta.lora
        if lora is not None:  # the step's adapters' deltas, in place (common/lora/batch.py)
            lora.apply(self.layer, "qkv", x, qkv)
        if self.qk_norm:
            qkv = self._norm_heads(qkv)
        scale, fp8_scaled = self.scale, False
        if kv_layer.dtype == FP8:  # an FP8 KV cache (the e4m3 of FP8 weights)
            scale *= self.k_scale
            fp8_scaled = self.k_scale != 1.0 or self.v_scale != 1.0
            if fp8_scaled:  # the cache's units (rotating K / s is rotating K, then / s)
                k_v = qkv[:, self.q_size :].unflatten(1, (2, self.kv_size))
                k_v[:, 0].div_(self.k_scale)
                k_v[:, 1].div_(self.v_scale)
        hooks = meta.hooks
        if hooks is not None:
            hooks.before_layer(self.layer)  # remote KV of this layer must have landed
        q = _ops.rotary_embedding_and_cache(
            qkv,
            positions,
            rotary.cos_sin_cache,
            kv_layer,
            meta.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )  # (T, H, D); rotated k and v are in the cache now
        if hooks is not None:
            hooks.after_layer(self.layer, kv_layer)
        o = self.backend.attend(q, kv_layer, meta, scale)  # (T, H, D)
        if fp8_scaled and self.v_scale != 1.0:
            o = o * self.v_scale
        o = o.view(-1, self.q_size)
        out = self.o_proj(o)
        if lora is not None:
            lora.apply(self.layer, "o", o, out)
        return out

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3: each q and k head RMS-normalised over ``head_dim`` (heads as the norm's rows),
        v untouched; ``(T, (H + 2 Hkv) D)`` in and out, as HF normalises before RoPE."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)  # (T H, D) rows
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)  # (T Hkv, D) rows
        return torch.cat((q, k, v), dim=-1)


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int, tp: TensorParallel | None) -> None:
        super().__init__()
        self.layer = layer
        inter = args.intermediate_size // (tp.size if tp is not None else 1)
        self.gate_up_proj = projection(args.hidden_size, 2 * inter, False, args.fp8)
        self.down_proj = projection(inter, args.hidden_size, False, args.fp8, tp)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(_ops.silu_and_mul(self.gate_up_proj(x)))
        gate_up = self.gate_up_proj(x)
        lora.apply(self.layer, "gate_up", x, gate_up)
        h = _ops.silu_and_mul(gate_up)
        out = self.down_proj(h)
        lora.apply(self.layer, "down", h, out)
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        args: LlamaArgs,
        layer: int,
        backend: AttentionBackend,
        tp: TensorParallel | None,
        expert_parallel: bool = False,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(args, layer, backend, tp)
        self.mlp: nn.Module = (
            SparseMoe(args.moe, args.hidden_size, tp if expert_parallel else None)
            if args.moe is not None and layer in args.moe.sparse_layers
            else MLP(args, layer, tp)
        )
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, positions, x, residual, rotary, kv_layer, meta):
        """``(x, residual) → (x', residual')``; the residual add happens inside the norms."""
        if residual is None:  # first layer: the embeddings are the residual stream
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, rotary, kv_layer, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        if meta.lora is not None and isinstance(self.mlp, MLP):
            return self.mlp(h, meta.lora), residual
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """``forward`` maps flat token ids ``(T,)`` to final hidden states ``(T, hidden)``;
    ``compute_logits`` applies the head to the rows that need a next token."""

    def __init__(
        self,
        args: LlamaArgs,
        backend: AttentionBackend,
        max_positions: int,
        tp: TensorParallel | None = None,
        expert_parallel: bool = False,
    ) -> None:
        """``expert_parallel``: a MoE model's experts are sharded whole over ``tp``."""
        super().__init__()
        self.args, self.tp = args, tp
        self.num_local_kv_heads = local_heads(args, tp)[1]  # this rank's slice of the KV cache
        self.embed_tokens: nn.Module
        self.lm_head: nn.Module
        if tp is None:
            self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        else:
            self.embed_tokens = VocabParallelEmbedding(args.vocab_size, args.hidden_size, tp)
            self.lm_head = ParallelLMHead(args.vocab_size, args.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, backend, tp, expert_parallel) for i in range(args.num_layers)
        )
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(args, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """``kv_caches[l]``: layer ``l``'s view ``(2, N, bs, Hkv, D)`` of the paged cache."""
        x = self.embed_tokens(input_ids)  # (T, hidden)
        residual = None
        for layer, kv_layer in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, self.rotary, kv_layer, meta)
        return self.norm(x, residual)[0]

    def kv_scales(self) -> tuple[float, ...]:
        """Each layer's FP8 KV scales, ``(k_0, v_0, k_1, v_1, …)`` (ones: none were given)."""
        attention = [layer.self_attn for layer in self.layers]
        return tuple(s for a in attention for s in (a.k_scale, a.v_scale))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(B, vocab)`` fp32 for the sampler. Under TP a collective: rank 0 calls this while
        every other rank calls ``lm_head`` on the same rows (its share of the gather)."""
        if self.tp is not None:
            logits = self.lm_head(hidden)
            assert logits is not None, "only rank 0 samples"
            return logits
        return self.lm_head(hidden).float()
