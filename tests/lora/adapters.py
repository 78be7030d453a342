"""PEFT adapters written by the tests (random LoRA weights) and the HF + PEFT reference."""

from __future__ import annotations

from pathlib import Path

import torch

# two adapters unlike each other: ranks 8 and 16, attention-only and attention + MLP
ADAPTERS = {
    "alpha": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "beta": dict(
        r=16,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
}


def base_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def write_adapter(model_dir: Path, out: Path, seed: int, **lora_args) -> Path:
    """A PEFT LoRA of ``model_dir`` with random A and B (``init_lora_weights=False``), scaled so
    that it changes the greedy tokens."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base_model(model_dir), LoraConfig(init_lora_weights=False, **lora_args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)  # PEFT's random init is small: make the adapter matter
    model.save_pretrained(str(out))
    return out


def write_test_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """``ADAPTERS`` written under ``root`` for ``model_dir``, by name."""
    return {
        name: write_adapter(model_dir, root / name, seed, **args)
        for seed, (name, args) in enumerate(ADAPTERS.items())
    }


def base_and_adapters(llm, dirs: dict[str, Path]) -> list:
    """The three ways to run a prompt: the base model, then each of ``dirs``' adapters."""
    return [None, *(llm.lora(name, str(path)) for name, path in dirs.items())]


def peft_model(model_dir: Path, adapter_dir: Path | None):
    """HF transformers with the adapter applied by PEFT (None: the base model)."""
    model = base_model(model_dir)
    if adapter_dir is None:
        return model
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()
