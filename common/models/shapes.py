"""Named model shapes for benchmarks: an HF ``config.json`` (no weights) to run with
``load_format="dummy"``. The tokenizer files of ``tiny-llama`` are copied beside it so the
offline ``LLM`` can start; benchmarks send token ids, so the vocabulary mismatch is harmless."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.cache_dir import default_cache_root
from common.models.tiny import resolve_model_path

_LLAMA_3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# 8 layers x 8 KV heads x 64 dims in fp32: 32 KiB of KV per token, the CPU KV-path benchmark
_CPU_KV32K: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 1024,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

SHAPES: dict[str, dict[str, Any]] = {
    "cpu-kv32k": _CPU_KV32K,
    # the smallest Llama: a step's model work is microseconds, so a step's wall is the host's
    # own work (scheduling, inputs, sampling launch, outputs): benchmarks/host_step.py
    "host-overhead": _CPU_KV32K
    | {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 32,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": _LLAMA_3_ROPE,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    # Qwen3-30B-A3B's config (128 experts, 8 active, 768-wide): the MoE benchmark shape; with
    # --shape-layers 1 or 2 it fits one GPU beside HF for the throughput comparison
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}


def write_dummy_shape(name: str, num_layers: int | None = None) -> Path:
    """A config-only model directory of shape ``name`` (``num_layers`` overrides the depth,
    for quick smoke runs). Returns its path; rewriting it is idempotent."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}")
    config = dict(SHAPES[name])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    suffix = f"-{num_layers}l" if num_layers is not None else ""
    out = default_cache_root() / "shapes" / f"{name}{suffix}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tiny = resolve_model_path("tiny-llama")
    for file in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / file).write_bytes((tiny / file).read_bytes())
    return out
