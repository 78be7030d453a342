"""What an HF ``config.json`` says about whether pdserve can serve the model, checked without
torch: the engine and ``pdserve up`` ask the same questions, so `up` refuses a model it cannot
serve in one line, before it starts a process, and the engine gives the same reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DENSE_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")  # common/models/moe.py
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
DEFAULT_MAX_POSITIONS = 2048  # a config that names no max_position_embeddings


def architecture(hf_config: dict[str, Any]) -> str:
    """The config's architecture; ValueError when pdserve has no model code for it."""
    arch = (hf_config.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {ARCHITECTURES}")
    return arch


def check_tensor_parallel(
    hf_config: dict[str, Any], size: int, expert_parallel: bool = False
) -> None:
    """ValueError when the model cannot be split over ``size`` ranks: a mixture-of-experts
    model's experts are sharded whole across the ranks (``expert_parallel``), never sliced."""
    arch = architecture(hf_config)
    if size > 1 and arch in MOE_ARCHITECTURES and not expert_parallel:
        raise ValueError(
            f"{arch} shards its experts across ranks: at tensor_parallel_size {size} pass"
            " --enable-expert-parallel (or serve it with tensor_parallel_size 1)"
        )
    experts = int(hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0)
    if size > 1 and expert_parallel and arch in MOE_ARCHITECTURES and experts < size:
        raise ValueError(f"{experts} experts cannot be sharded over {size} ranks")


def max_model_len(hf_config: dict[str, Any], asked: int | None) -> int:
    """The context an engine serves: ``asked``, or the model's limit; ValueError past it."""
    limit = int(hf_config.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
    if asked is not None and asked > limit:
        raise ValueError(f"max_model_len {asked} exceeds the model's limit {limit}")
    return asked or limit


def eos_token_ids(model_dir: str | Path, config: dict[str, Any]) -> list[int]:
    """The ids that end generation: ``generation_config.json``'s ``eos_token_id`` (one id or a
    list), else the model config's. What the engine stops on and what a search (offline or the
    router's) treats as a beam's end."""
    ids: Any = None
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id")
    if ids is None:
        ids = config.get("eos_token_id")
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, list) else [ids])]
