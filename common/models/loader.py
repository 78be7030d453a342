"""Load an HF model directory (config.json + single or sharded safetensors) into our modules.

HF names map one to one except the fused projections: ``q_proj|k_proj|v_proj`` → ``qkv_proj``
and ``gate_proj|up_proj`` → ``gate_up_proj`` (each checkpoint tensor is copied into its rows).
MoE experts (``common/models/moe.py``) are stacked ``experts.gate_up_proj (E, 2 I, H)`` and
``experts.down_proj (E, H, I)``, filled from either layout a checkpoint has:

- stacked, as transformers 5 holds them: ``mlp.experts.gate_up_proj`` / ``.down_proj``;
- per expert, as the Hub's checkpoints and transformers' ``save_pretrained`` write them:
  Qwen3-MoE ``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``, Mixtral
  ``block_sparse_moe.experts.{e}.w1|w3|w2.weight`` (gate, up, down; its router
  ``block_sparse_moe.gate`` is our ``mlp.gate``).

FP8 checkpoints (``common/models/fp8.py``): each projection's ``weight_scale`` (or block-wise
``weight_scale_inv``, its grid's rows expanded, ``common/models/fp8_blocks.py``) goes beside
its weight; experts' scales stack like their weights: per expert
``experts.{e}.w1.weight_scale``, stacked ``experts.gate_up_proj_scale(_inv)``, per tensor, per
output channel or per block.

Under tensor parallelism each rank reads only its slices (safetensors ``get_slice``): q/k/v rows
of its heads (a KV head shared by several ranks is read by each), gate/up rows and down_proj
columns of its intermediate range, o_proj columns of its heads, embedding and LM head rows of
its vocabulary range (zero-padded past the vocabulary); norms and o_proj's bias whole.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from common.attention import AttentionBackend
from common.models.fp8 import FP8, quantize_model, weight_block
from common.models.fp8_blocks import fit_scale, use_block_scales
from common.models.llama import LlamaArgs, LlamaForCausalLM, local_heads
from common.models.preflight import check_tensor_parallel
from common.parallel.group import TensorParallel, check_divisible

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_FUSED = {  # HF suffix → (our suffix, shard index)
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_EXPERT = {  # per-expert HF suffix → (our stacked parameter, shard of gate_up_proj)
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),  # Mixtral
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}


class Target(NamedTuple):
    """Where one checkpoint tensor goes: parameter ``name``, its ``shard`` of a fused
    projection (None: all rows), its ``expert`` of a stacked MoE weight (None: all experts)."""

    name: str
    shard: int | None = None
    expert: int | None = None

    @property
    def key(self) -> str:
        """What ``_check_complete`` counts as loaded."""
        if self.shard is None and self.expert is None:
            return self.name
        return f"{self.name}#{self.expert}.{self.shard}"


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    return json.loads(path.read_text())


def resolve_dtype(name: str, hf_config: dict[str, Any]) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype (fp32 when it names none)."""
    if name == "auto":
        name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32")
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``--kv-cache-dtype``: ``auto`` is the model's dtype;
    ``fp8`` (``fp8_e4m3``) is e4m3, values divided by each layer's scales (``Attention``)."""
    if name == "auto":
        return model_dtype
    if name in ("fp8", "fp8_e4m3"):
        return torch.float8_e4m3fn
    raise ValueError(f"unsupported kv_cache_dtype {name!r}; use auto or fp8")


def build_model(
    model_dir: Path,
    hf_config: dict[str, Any],
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    max_positions: int,
    load_format: str = "auto",
    seed: int = 0,
    tp: TensorParallel | None = None,
    expert_parallel: bool = False,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """Construct the model on ``device`` in ``dtype`` and fill its weights (``tp``: this rank's
    shard only; ``expert_parallel``: a MoE model's experts sharded whole over ``tp``;
    ``quantization``: ``"fp8"`` quantizes an unquantized checkpoint's projections at load, an
    FP8 checkpoint loads as FP8 either way, ``common/models/fp8.py``)."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"unsupported quantization {quantization!r}; use fp8")
    args = LlamaArgs.from_hf(hf_config)
    check_tensor_parallel(hf_config, tp.size if tp is not None else 1, expert_parallel)
    if tp is not None:
        check_divisible(tp.size, args.num_heads, args.num_kv_heads, args.intermediate_size)
    block = weight_block(hf_config)
    if block is not None and tp is not None and tp.size > 1:
        raise ValueError("block-wise FP8 scales under tensor parallelism are not supported yet")
    start = time.perf_counter()
    model = build_on_meta(args, backend, max_positions, tp, expert_parallel)
    if block is not None:
        use_block_scales(model, block[1])
    materialize(model, dtype, device)
    if load_format == "dummy":
        _fill_dummy(model, seed)
    else:
        experts = range(args.moe.num_experts if args.moe is not None else 0)
        if tp is not None and expert_parallel:
            experts = range(*tp.split(len(experts)))
        _load_safetensors(model, model_dir, args, tp, experts, block)
    if quantization == "fp8" and not args.fp8:
        quantize_model(model)
    model.eval()
    logger.info("model loaded in %.2fs (%s, %s)", time.perf_counter() - start, dtype, device)
    return model


def build_on_meta(
    args: LlamaArgs,
    backend: AttentionBackend,
    max_positions: int,
    tp: TensorParallel | None,
    expert_parallel: bool = False,
) -> LlamaForCausalLM:
    """The model's modules with ``meta`` parameters: shapes only, nothing allocated or
    initialised (``materialize`` gives it storage)."""
    with torch.device("meta"):
        return LlamaForCausalLM(args, backend, max_positions, tp, expert_parallel)


def materialize(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Give a model built on ``meta`` its storage: every parameter allocated once, on
    ``device``, in ``dtype``, uninitialised (the checkpoint or the dummy fill writes each one),
    so loading never holds more than the model's size in its dtype on the device. A tied
    parameter stays one tensor; the rotary table is computed on ``device`` in fp32, then cast
    (the values a model built there had before)."""
    made: dict[int, nn.Parameter] = {}  # a tied parameter is one object: made once
    for module in model.modules():
        keep = getattr(module, "KEEP_DTYPE", ())  # FP8 weights and their fp32 scales
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in made:
                kind = param.dtype if name in keep else dtype
                data = torch.empty(param.shape, dtype=kind, device=device)
                made[id(param)] = nn.Parameter(data, requires_grad=False)
            setattr(module, name, made[id(param)])
    with torch.device(device):
        model.rotary.fill(dtype)


def _fill_dummy(model: LlamaForCausalLM, seed: int) -> None:
    """Small random weights for benchmark shapes (no checkpoint needed): drawn in fp32 on the
    host from one seeded stream, cast there, then copied (the device holds only the result)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.empty(param.shape).uniform_(-0.02, 0.02, generator=gen)
        if name.endswith("norm.weight"):  # every RMSNorm (Qwen3's q_norm/k_norm too): ones
            values = torch.ones(param.shape)
        param.data.copy_(values.to(param.dtype))


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors weights")
    return files


def _load_safetensors(
    model: LlamaForCausalLM,
    model_dir: Path,
    args: LlamaArgs,
    tp: TensorParallel | None,
    experts: range,
    block: tuple[int, int] | None = None,
) -> None:
    """``experts``: the MoE experts this rank holds, whole (all of them but under expert
    parallelism); a stacked expert tensor is read in that range, a per-expert one only when
    its expert is in it. ``block``: an FP8 checkpoint's ``weight_block_size``."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    files = _checkpoint_files(model_dir)
    for path in tqdm(files, desc="loading weights", disable=len(files) < 2, leave=False):
        with safe_open(str(path), framework="pt") as f:
            for hf_name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                if _kv_scale(model, hf_name, f):
                    continue
                target = _map_name(hf_name, args)
                if target is None:
                    continue
                if ".experts." in target.name:
                    if target.expert is not None and target.expert not in experts:
                        continue  # another rank's expert
                    tensor = (
                        f.get_tensor(hf_name)
                        if target.expert is not None
                        else f.get_slice(hf_name)[experts.start : experts.stop]
                    )
                    target = target._replace(
                        expert=None if target.expert is None else target.expert - experts.start
                    )
                elif tp is None:
                    tensor = f.get_tensor(hf_name)
                else:
                    tensor = _read_shard(f, hf_name, target.name, target.shard, args, tp)
                _copy_into(params[target.name], tensor, target, args, tp, block)
                loaded.add(target.key)
    _check_complete(params, loaded, args, len(experts))


_KV_SCALE = re.compile(
    r"(?:model\.)?layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?([kv])_scale$"
)


def _kv_scale(model: LlamaForCausalLM, hf_name: str, f: Any) -> bool:
    """An FP8 KV scale of the checkpoint (``layers.N.self_attn.k_scale``; llm-compressor and
    older vLLM exports put it under ``k_proj.``/``attn.``): set on its layer (used only with
    an FP8 cache). False: not one."""
    match = _KV_SCALE.fullmatch(hf_name)
    if match is None:
        return False
    tensor = f.get_tensor(hf_name)
    if tensor.numel() != 1:
        raise ValueError(
            f"{hf_name} has {tensor.numel()} values: per-head KV scales are not supported"
        )
    value = float(tensor.float().reshape(-1)[0])
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{hf_name} = {value}: a KV scale must be positive and finite")
    attention = model.layers[int(match.group(1))].self_attn
    setattr(attention, f"{match.group(2)}_scale", value)
    return True


def _map_name(hf_name: str, args: LlamaArgs) -> Target | None:
    """HF tensor name → where it goes (None: not a weight of ours)."""
    if "rotary_emb" in hf_name or hf_name.endswith((".input_scale", "_activation_scale")):
        return None  # (FP8: activations are scaled per token, never by a static scale)
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    if name.endswith("_scale_inv"):  # block-wise checkpoints' name: the multiplier too
        name = name.removesuffix("_inv")
    if name == "lm_head.weight" and args.tie_word_embeddings:
        return None
    parts = name.split(".")
    if "experts" in parts:
        return _map_expert(parts)
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            return Target(".".join([*parts[:i], fused, *parts[i + 1 :]]), shard)
    return Target(name)


def _map_expert(parts: list[str]) -> Target:
    """``….experts.gate_up_proj(_scale)`` (stacked) or ``….experts.{e}.{proj}.weight(_scale)``
    (one expert)."""
    i = parts.index("experts")
    if not parts[i + 1].isdigit():
        return Target(".".join(parts))
    stacked, shard = _EXPERT[parts[i + 2]]
    if parts[-1] == "weight_scale":
        stacked += "_scale"
    return Target(".".join([*parts[: i + 1], stacked]), shard, int(parts[i + 1]))


def _read_shard(
    f: Any, hf_name: str, name: str, shard: int | None, a: LlamaArgs, tp: TensorParallel
) -> torch.Tensor:
    """This rank's slice of one checkpoint tensor, read without reading the rest."""
    part = f.get_slice(hf_name)
    if name.endswith(".weight_scale") and math.prod(part.get_shape()) == 1:
        return f.get_tensor(hf_name)  # one scale for the whole tensor: every rank's rows
    if name.endswith(("o_proj.weight_scale", "down_proj.weight_scale")):
        return f.get_tensor(hf_name)  # row-parallel: the output channels are whole on each rank
    d = a.head_dim
    if shard is not None and "qkv_proj" in name:
        if shard == 0:
            begin, end = tp.split(a.num_heads)
        else:
            begin, end = tp.kv_head_range(a.num_kv_heads)
        return part[begin * d : end * d]
    if shard is not None:  # gate or up: intermediate rows
        begin, end = tp.split(a.intermediate_size)
        return part[begin:end]
    if name.endswith("o_proj.weight"):
        begin, end = tp.split(a.num_heads)
        return part[:, begin * d : end * d]
    if name.endswith("down_proj.weight"):
        begin, end = tp.split(a.intermediate_size)
        return part[:, begin:end]
    if name in ("embed_tokens.weight", "lm_head.weight"):
        begin, end = tp.vocab_range(a.vocab_size)
        rows = part[begin : min(end, a.vocab_size)]
        pad = rows.new_zeros((end - begin - rows.shape[0], rows.shape[1]))
        return torch.cat((rows, pad)) if pad.shape[0] else rows
    return part[:]  # norms, o_proj's bias: whole on every rank


def _copy_into(
    param: torch.Tensor,
    tensor: torch.Tensor,
    target: Target,
    a: LlamaArgs,
    tp: TensorParallel | None = None,
    block: tuple[int, int] | None = None,
) -> None:
    dst = param.data if target.expert is None else param.data[target.expert]
    shard = target.shard
    if shard is not None:
        heads, kv_heads = local_heads(a, tp)
        q, kv = heads * a.head_dim, kv_heads * a.head_dim
        inter = a.intermediate_size // (tp.size if tp is not None else 1)
        if ".experts." in target.name and a.moe is not None:
            inter = a.moe.intermediate_size
        sizes = [q, kv, kv] if "qkv_proj" in target.name else [inter, inter]
        begin = sum(sizes[:shard])
        dst = dst[begin : begin + sizes[shard]]
    if target.name.endswith("_scale"):
        tensor = fit_scale(tensor, dst, block)
    if dst.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(tensor.shape)} for {tuple(dst.shape)}")
    if dst.dtype == FP8 and tensor.dtype != FP8:
        raise ValueError(f"{target.name}: an FP8 checkpoint holds {tensor.dtype} here")
    dst.copy_(tensor.to(dst.dtype))  # cast on the host: no wider copy on the device


def _check_complete(
    params: Mapping[str, torch.Tensor], loaded: set[str], args: LlamaArgs, num_experts: int
) -> None:
    """``num_experts``: the experts this rank holds (numbered from 0 here)."""
    missing = []
    for name in params:
        if args.tie_word_embeddings and name == "lm_head.weight":
            continue
        if name not in loaded and any(k not in loaded for k in _pieces(name, num_experts)):
            missing.append(name)
    if missing:
        more = "…" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing weights: {missing[:5]}{more}")


def _pieces(name: str, num_experts: int) -> list[str]:
    """The keys that, all loaded, fill parameter ``name`` piece by piece (none: only whole)."""
    experts = range(num_experts) if ".experts." in name else None
    if experts is not None:
        shards = (0, 1) if "gate_up_proj" in name else (None,)
        return [Target(name, s, e).key for e in experts for s in shards]
    if "qkv_proj" in name or "gate_up_proj" in name:
        return [Target(name, s).key for s in range(3 if "qkv_proj" in name else 2)]
    return []
