"""What names a LoRA adapter, and what its PEFT directory must hold (plain Python, no torch).

An adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them. Its
identity is its name *and* a hash of those two files' bytes: KV computed under one adapter is
not another's (nor the base model's), so the identity goes into every block hash
(``Request.hash_salt``), hence into the prefix cache and the store keys, and into the KV
handle's fingerprint (``handle_fingerprint``). Same name, new weights: a new identity, so KV of
the old weights is never served for the new ones.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name → (our fused projection, slice of it): q|k|v and gate|up are one GEMM each
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
MLP_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj"})


class LoraRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An adapter as a request names it: ``name`` (what clients send as ``model``), ``path``
    (its PEFT directory on this node) and ``content_hash`` (of its files, hex)."""

    name: str
    path: str
    content_hash: str

    @property
    def identity(self) -> str:
        """What the KV it produces is keyed by: name and content."""
        return f"{self.name}@{self.content_hash[:16]}"


@dataclass(frozen=True)
class AdapterConfig:
    """The parts of ``adapter_config.json`` the server reads, checked."""

    rank: int
    alpha: float
    targets: frozenset[str]  # PEFT module names, a subset of TARGETS
    rslora: bool  # scaling alpha / sqrt(r) instead of alpha / r

    @property
    def scaling(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


def read_adapter(name: str, path: str | Path, max_rank: int) -> tuple[LoraRef, AdapterConfig]:
    """Check a PEFT LoRA directory and name it. ValueError, saying why, for anything this server
    cannot serve exactly (DoRA, biases, per-module ranks, embedding or LM-head targets, a rank
    over ``max_rank``)."""
    if not name or any(c.isspace() for c in name):
        raise ValueError(f"adapter name {name!r} must be non-empty without spaces")
    root = Path(path)
    try:
        raw = (root / CONFIG_FILE).read_bytes()
        cfg = json.loads(raw)
    except (OSError, ValueError) as e:
        raise ValueError(f"adapter {name!r}: cannot read {root / CONFIG_FILE}: {e}") from None
    config = _check_config(name, cfg, max_rank)
    digest = hashlib.sha256(raw)
    try:
        with open(root / WEIGHTS_FILE, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as e:
        raise ValueError(f"adapter {name!r}: cannot read {root / WEIGHTS_FILE}: {e}") from None
    return LoraRef(name, str(root.resolve()), digest.hexdigest()), config


def adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    """The checked config of an adapter already named (the engine, at load)."""
    root = Path(path)
    return _check_config(root.name, json.loads((root / CONFIG_FILE).read_text()), max_rank)


def _check_config(name: str, cfg: dict, max_rank: int) -> AdapterConfig:
    def refuse(why: str) -> ValueError:
        return ValueError(f"adapter {name!r}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        raise refuse(f"peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, what in (
        ("use_dora", "DoRA"),
        ("modules_to_save", "modules_to_save"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("lora_bias", "LoRA biases"),
        ("trainable_token_indices", "trainable tokens"),
        ("layer_replication", "layer replication"),
    ):
        if cfg.get(key):
            raise refuse(f"{what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise refuse(f"bias={cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise refuse("fan_in_fan_out is not supported")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise refuse(f"rank {rank} is over --max-lora-rank {max_rank}")
    targets = cfg.get("target_modules")
    if isinstance(targets, str):  # PEFT allows a regex; only plain names are served
        targets = [targets] if targets in TARGETS else None
    if not targets:
        raise refuse(f"target_modules must list module names of {sorted(TARGETS)}")
    unknown = set(targets) - set(TARGETS)
    if unknown:
        raise refuse(f"target modules {sorted(unknown)} are not supported ({sorted(TARGETS)})")
    return AdapterConfig(rank, float(cfg.get("lora_alpha", 8)), frozenset(targets),
                         bool(cfg.get("use_rslora")))  # fmt: skip


def handle_fingerprint(fingerprint: str, lora: LoraRef | None) -> str:
    """The fingerprint a KV handle carries: the store layout's, and the adapter's identity when
    the KV was computed under one (a consumer compares it with its own for the request)."""
    return fingerprint if lora is None else f"{fingerprint}+lora:{lora.identity}"


def parse_lora_modules(specs: list[str]) -> dict[str, str]:
    """``--lora-modules name=path …`` → {name: path} (vLLM's form; a JSON object
    ``{"name": …, "path": …}`` also works)."""
    out: dict[str, str] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            item = json.loads(spec)
            name, path = item.get("name"), item.get("path")
        else:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
        if not name or not path:
            raise ValueError(f"--lora-modules entry {spec!r} needs a name and a path")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out
