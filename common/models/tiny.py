"""Built-in tiny random models, generated deterministically on first use.

`tiny-llama` (the default model everywhere), `tiny-qwen2` and `tiny-qwen3` (q/k norms, a
`head_dim` wider than `hidden_size / heads`), and the mixture-of-experts `tiny-mixtral` and
`tiny-qwen3-moe` let every component, test and demo run with no download. On first use a model
is written, as an ordinary Hugging Face model directory, into `<cache root>/models/<name>-v1`
(cache root: `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`):

    config.json  generation_config.json  model.safetensors
    tokenizer.json  tokenizer_config.json (with chat_template)  special_tokens_map.json

so `transformers.AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)`
load the very same directory offline.

NOTE on determinism: the tokenizer is a byte-level BPE trained on a built-in corpus and the
weights are drawn from a seeded `torch.Generator` by our own init (HF's `_init_weights` changes
across versions). We also write the safetensors files ourselves, so `tokenizer.json` and the
weight files are byte-identical across generations. The init scale is deliberately large: with
HF's std=0.02 a random model's logits are nearly uniform and greedy decoding would hinge on
1e-6 ties, so tests comparing our engine with HF token by token would be flaky.

NOTE on concurrency: several server processes may start at once on a cold cache; the model is
built through `common.cache_dir.build_once` (private temp directory, one atomic `rename`), so a
directory at the target path is complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from common.cache_dir import build_once
from common.models import names
from common.models.names import is_complete as _is_complete
from common.models.names import is_tiny_model, tiny_model_dir

logger = logging.getLogger(__name__)

Arch = Literal["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Qwen2's split (digits one by one, no leading-space letters glued to punctuation). With NFC
# normalisation it is what transformers>=5 rebuilds for any `qwen2` model, so tokenizer.json
# must use it too, or raw `tokenizers` and AutoTokenizer would disagree.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A few KB of varied text: BPE needs enough distinct words to learn ~1-1.5k merges, and the
# non-ASCII lines make multi-byte characters span several byte-level tokens.
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a "
    "single step. To be, or not to be, that is the question. All that glitters is not gold.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his "
    "daughter. Every morning they rowed out before sunrise, and every evening they returned "
    "with baskets of silver fish, singing songs about the wind, the waves and the stars.",
    "Large language models predict the next token given the previous ones. Serving them "
    "efficiently means batching many requests, caching keys and values for attention, and "
    "splitting the prompt phase (prefill) from the generation phase (decode). Prefill is "
    "compute bound; decode is limited by memory bandwidth. Latency, throughput and goodput "
    "are measured in milliseconds, tokens per second and requests per second.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"
    " + fibonacci(n - 2)\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
    '{"model": "tiny-llama", "prompt": "Hello, world!", "max_tokens": 16, "temperature": 0.7, '
    '"top_p": 0.95, "stream": true, "stop": ["\\n\\n"]}',
    "Weather report: Monday will be sunny with a high of 24 degrees; Tuesday brings clouds, "
    "light rain and wind from the north-west; by Wednesday evening temperatures drop to 9 "
    "degrees. Farmers, sailors and cyclists should plan accordingly.",
    "Recipe: mix two cups of flour, one cup of sugar, three eggs and a pinch of salt. Bake "
    "for forty minutes at 180 degrees until golden. Serve warm with fresh berries and cream.",
    "History is full of surprising inventions: the printing press, the steam engine, the "
    "telephone, the transistor and the internet each changed how people work, learn, trade "
    "and communicate. Scientists, engineers, writers and artists built on each other's ideas.",
    "She opened the window, looked at the garden and said quietly: \"It's going to be a "
    'beautiful day." He laughed, poured two cups of coffee and asked whether they could walk '
    "to the market, the library, the museum or the park after breakfast.",
    "Numbers and symbols: 0 1 2 3 4 5 6 7 8 9 10 42 100 256 1024 2048 3.14159 2.71828 "
    "1,000,000 50% $19.99 #hashtag @user a+b=c x*y/z (parentheses) [brackets] {braces} <tags>",
    "Questions and answers. What is the capital of France? Paris. How many days are in a "
    "week? Seven. Why is the sky blue? Because air scatters blue light more than red light. "
    "Who wrote this sentence? Nobody knows, but everybody can read it.",
    "Unicode: café, naïve, résumé, façade, coöperate, jalapeño, Zürich, Åland, São Paulo, "
    "smörgåsbord, crème brûlée. Ελληνικά, русский язык, עברית, العربية, हिन्दी.",
    "中文字符：你好，世界！我们喜欢学习语言模型。今天天气很好。日本語：こんにちは、ありがとう。"
    "한국어: 안녕하세요. Emoji: 😀 😂 🚀 🌍 ❤️ 👍 🎉 🐍 🍕 ✨ 👩‍💻",
    "The committee met on Thursday to discuss the budget, the schedule and the new policy. "
    "After a long debate, members agreed to postpone the final decision until the next "
    "meeting, when more information about costs, risks and benefits would be available.",
    "Mountains rise above the valley; rivers carry snow melt to the lakes; forests of pine, "
    "oak and birch shelter deer, foxes, owls and bears. Hikers follow narrow trails, cross "
    "wooden bridges and camp beneath bright constellations far from city lights.",
)


@dataclass(frozen=True)
class TinyModelSpec:
    """How one built-in model is generated. `config` holds the HF config fields that do not
    depend on the tokenizer (vocab size and special ids are filled in from it)."""

    name: str
    arch: Arch
    config: dict[str, Any]
    seed: int
    trained_vocab: int  # BPE trainer target (bytes + merges, + specials when `specials_first`)
    pretokenizer: Literal["gpt2", "qwen2"]  # gpt2: ByteLevel's own regex; qwen2: NFC + split
    specials: tuple[str, ...]
    specials_first: bool  # True: specials get ids 0.. (Llama); False: appended at the end (Qwen)
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    add_bos: bool
    chat_template: str
    extra_tokens: tuple[str, ...] = field(default=())  # special, but not bos/eos/pad/unk


TINY_MODELS: dict[str, TinyModelSpec] = {
    "tiny-llama": TinyModelSpec(
        name="tiny-llama",
        arch="llama",
        config=dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
            tie_word_embeddings=False,
        ),
        seed=1234,
        trained_vocab=1000,
        pretokenizer="gpt2",
        specials=("<unk>", "<s>", "</s>", "<pad>", "<|start_header_id|>", "<|end_header_id|>"),
        specials_first=True,
        bos="<s>",
        eos="</s>",
        pad="<pad>",
        unk="<unk>",
        add_bos=True,
        chat_template=_LLAMA_CHAT_TEMPLATE,
        extra_tokens=("<|start_header_id|>", "<|end_header_id|>"),
    ),
    "tiny-qwen2": TinyModelSpec(
        name="tiny-qwen2",
        arch="qwen2",
        config=dict(
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            use_sliding_window=False,
        ),
        seed=4321,
        trained_vocab=1400,
        pretokenizer="qwen2",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        specials_first=False,
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        unk=None,
        add_bos=False,
        chat_template=_CHATML_TEMPLATE,
        extra_tokens=("<|im_start|>", "<|im_end|>"),
    ),
}
# Qwen3's shape in small: head_dim (64) wider than hidden / heads (32), GQA, no qkv bias; the
# tokenizer and chat format are tiny-qwen2's
TINY_MODELS["tiny-qwen3"] = dataclasses.replace(
    TINY_MODELS["tiny-qwen2"],
    name="tiny-qwen3",
    arch="qwen3",
    config={
        **TINY_MODELS["tiny-qwen2"].config,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "attention_bias": False,
    },
    seed=5678,
)
# Mixtral in small: tiny-llama's tokenizer and attention, every layer 4 experts of which each
# token takes 2 (Mixtral's 8 choose 2, halved). Expert widths are multiples of 32, as real ones.
TINY_MODELS["tiny-mixtral"] = dataclasses.replace(
    TINY_MODELS["tiny-llama"],
    name="tiny-mixtral",
    arch="mixtral",
    config={
        key: value
        for key, value in TINY_MODELS["tiny-llama"].config.items()
        if key not in ("rope_scaling", "intermediate_size", "num_hidden_layers")
    }
    | {
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "rope_theta": 1000000.0,
        "sliding_window": None,
    },
    seed=2468,
)
# Qwen3-MoE in small: tiny-qwen3's tokenizer and attention (q/k norms), 8 experts, top 2 with
# the top-k weights renormalised (Qwen3-30B-A3B's ``norm_topk_prob``), every layer sparse
TINY_MODELS["tiny-qwen3-moe"] = dataclasses.replace(
    TINY_MODELS["tiny-qwen3"],
    name="tiny-qwen3-moe",
    arch="qwen3_moe",
    config={
        **TINY_MODELS["tiny-qwen3"].config,
        "num_hidden_layers": 3,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    seed=8642,
)


def resolve_model_path(name_or_path: str) -> Path:
    """Map a model argument to a HF model directory.

    A built-in name is generated if needed (in this process); an existing directory holding
    `config.json` is returned as is. Anything else raises ValueError. Never touches the network.
    (Torch-free callers use `common.models.names.resolve_model_path`.)
    """
    return names.resolve_model_path(name_or_path, generate=ensure_tiny_model)


def ensure_tiny_model(name: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the directory of built-in model `name`, generating it on first use.

    `cache_dir` is the pdserve cache root (default: `default_cache_root()`); the model lives in
    `<cache_dir>/models/<name>-v1`. Safe to call from several processes at once.
    """
    if not is_tiny_model(name):
        raise ValueError(f"{name!r} is not a built-in model ({', '.join(TINY_MODELS)})")
    target = tiny_model_dir(name, cache_dir)
    if _is_complete(target):
        return target
    logger.info("generating built-in model %s into %s (first use, takes seconds)", name, target)
    start = time.perf_counter()
    published = build_once(target, lambda tmp: _generate(TINY_MODELS[name], tmp), _is_complete)
    logger.debug("built-in model %s ready in %.1fs", name, time.perf_counter() - start)
    return published


def _generate(spec: TinyModelSpec, out_dir: Path) -> None:
    tokenizer = _train_tokenizer(spec)
    _save_tokenizer(spec, tokenizer, out_dir)
    config = _build_config(spec.arch, _tiny_config_kwargs(spec, tokenizer), torch.float32)
    _save_model_files(config, out_dir, spec.seed, shards=1, dtype=torch.float32)


# ---------------------------------------------------------------------------------- tokenizer


def _untrained_bpe(spec: TinyModelSpec) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    if spec.pretokenizer == "qwen2":
        tokenizer.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _train_tokenizer(spec: TinyModelSpec) -> Tokenizer:
    """Train the byte-level BPE on the built-in corpus (deterministic: ties in the trainer's
    merge queue are broken by token ids, which are assigned in sorted order)."""
    tokenizer = _untrained_bpe(spec)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.trained_vocab,
        special_tokens=list(spec.specials) if spec.specials_first else [],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is encodable
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    if not spec.specials_first:
        tokenizer.add_special_tokens(list(spec.specials))
    if spec.add_bos:
        assert spec.bos is not None
        bos = (spec.bos, tokenizer.token_to_id(spec.bos))
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A {spec.bos} $B", special_tokens=[bos]
        )
    return tokenizer


def _save_tokenizer(spec: TinyModelSpec, tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer files in the classic layout (chat template inside tokenizer_config.json,
    special_tokens_map.json), which every transformers version and our router can read."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    named = dict(bos_token=spec.bos, eos_token=spec.eos, pad_token=spec.pad, unk_token=spec.unk)
    special_map: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    special_map["additional_special_tokens"] = list(spec.extra_tokens)
    tokenizer_config = {
        **special_map,
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        "chat_template": spec.chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.config["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(out_dir / "special_tokens_map.json", special_map)
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)


def _tiny_config_kwargs(spec: TinyModelSpec, tokenizer: Tokenizer) -> dict[str, Any]:
    def token_id(token: str | None) -> int | None:
        return None if token is None else tokenizer.token_to_id(token)

    bos = spec.bos if spec.bos is not None else spec.pad  # Qwen2 uses <|endoftext|> as bos
    return {
        **spec.config,
        "vocab_size": _round_up(tokenizer.get_vocab_size(), 64),
        "bos_token_id": token_id(bos),
        "eos_token_id": token_id(spec.eos),
        "pad_token_id": token_id(spec.pad),
    }


# ------------------------------------------------------------------------------------ weights


def _build_config(arch: Arch, config_kwargs: dict[str, Any], dtype: torch.dtype) -> Any:
    from transformers import (
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    config_cls = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "mistral": MistralConfig,
        "mixtral": MixtralConfig,
        "qwen3_moe": Qwen3MoeConfig,
    }[arch]
    config = config_cls(**config_kwargs, torch_dtype=str(dtype).removeprefix("torch."))
    config.architectures = [config_cls.__name__.replace("Config", "ForCausalLM")]
    return config


def _random_state_dict(config: Any, seed: int) -> dict[str, torch.Tensor]:
    """Build the HF model for `config` and overwrite every parameter from a seeded generator.

    Scales (why): linear weights ~ N(0, gain²/fan_in) keep activations O(1) through the stack;
    norms ~ 1 ± 0.1 and biases ~ N(0, 0.2²) so no parameter is trivially 1 or 0; the output
    projection is scaled to give logits of std ≈ 3 — well separated, yet not one-hot.
    Tied weights appear once in the result (like HF checkpoints).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(seed)
    hidden = config.hidden_size
    # Tied: logits = h · E with |h| ≈ sqrt(hidden), so E's std sets the logit spread.
    embed_std = 3.0 / math.sqrt(hidden) if config.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            param.copy_(_scale_init(name, param, noise, embed_std, hidden))
    return _dedup_tied(model.state_dict())


# Gains over N(0, 1/fan_in), chosen by measuring greedy decoding: sharper attention (q, k) and
# strong residual branches (o, down) keep the models from collapsing into repeating one token
# (with tied embeddings the input token's own embedding otherwise dominates the logits).
_LINEAR_GAIN = {"q_proj": 2.0, "k_proj": 2.0, "o_proj": 3.0, "down_proj": 3.0, "gate": 2.0}
# "gate" is a MoE router: logits of std ~2 make each token's top-k experts clear winners, so
# ulp-level differences never swap a chosen expert (they would change the output by far more)


# Qwen3's q/k norms make every head unit-RMS before the dot product, so the projections' gains
# no longer sharpen attention; the norms' weights do (at ~1 tiny-qwen3 repeats a few tokens).
_QK_NORM_GAIN = 3.0


def _scale_init(
    name: str, param: torch.Tensor, noise: torch.Tensor, embed_std: float, hidden: int
) -> torch.Tensor:
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return _QK_NORM_GAIN * (1.0 + 0.1 * noise)
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * noise
    if name.endswith(".bias"):
        return 0.2 * noise
    if "embed_tokens" in name:
        return embed_std * noise
    if name.startswith("lm_head"):
        return 3.0 / math.sqrt(hidden) * noise
    if param.dim() == 3:  # stacked experts (E, out, in): E linear weights
        gain = _LINEAR_GAIN.get(name.split(".")[-1], 1.0)
        return gain / math.sqrt(param.shape[2]) * noise
    gain = _LINEAR_GAIN.get(name.split(".")[-2], 1.0)
    return gain / math.sqrt(param.shape[1]) * noise  # (out, in) linear weight


def _dedup_tied(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses aliased tensors; keep the first name (embed_tokens before lm_head).
    seen: set[int] = set()
    unique: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            unique[name] = tensor
    return unique


def _save_model_files(
    config: Any, out_dir: Path, seed: int, shards: int, dtype: torch.dtype
) -> None:
    from transformers import GenerationConfig

    state_dict = _random_state_dict(config, seed)
    tensors = {k: v.to(dtype).contiguous() for k, v in state_dict.items()}
    _save_safetensors(tensors, out_dir, shards)
    config.save_pretrained(out_dir)
    _add_legacy_config_keys(out_dir / "config.json", dtype)
    generation = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    generation.save_pretrained(out_dir)


def _save_safetensors(tensors: dict[str, torch.Tensor], out_dir: Path, shards: int) -> None:
    """Write `model.safetensors`, or `shards` files plus `model.safetensors.index.json`."""
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
        return
    names = list(tensors)
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be in [1, {len(names)}], got {shards}")
    weight_map: dict[str, str] = {}
    for shard in range(shards):
        # Contiguous, equal-count slices: every shard is non-empty whatever the tensor sizes.
        chunk = names[shard * len(names) // shards : (shard + 1) * len(names) // shards]
        filename = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k] for k in chunk}, str(out_dir / filename), metadata=metadata)
        weight_map.update(dict.fromkeys(chunk, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def _add_legacy_config_keys(config_path: Path, dtype: torch.dtype) -> None:
    """Add the classic `rope_theta` / `rope_scaling` / `torch_dtype` keys that real checkpoints
    carry, next to transformers>=5's `rope_parameters` / `dtype`, so readers of either load it."""
    config = json.loads(config_path.read_text())
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope.pop("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            config.setdefault("rope_scaling", rope)
    config.setdefault("torch_dtype", str(dtype).removeprefix("torch."))
    _write_json(config_path, config)


# ----------------------------------------------------------------------- arbitrary checkpoints


def write_hf_checkpoint(
    out_dir: str | os.PathLike[str],
    config_kwargs: dict[str, Any],
    arch: Arch,
    seed: int,
    shards: int = 1,
    dtype: torch.dtype = torch.float32,
    tokenizer_from: str = "tiny-llama",
) -> Path:
    """Write a random HF checkpoint directory (for tests of the loader on real layouts).

    `config_kwargs` go to the arch's HF config class; `vocab_size`, `bos_token_id`,
    `eos_token_id` default to those of `tokenizer_from` (a built-in name or a model dir), whose
    tokenizer files are copied. With `shards > 1` weights are split over
    `model-0000i-of-0000N.safetensors` plus `model.safetensors.index.json`. Weights for a given
    (config, seed) are the same whatever `shards` and are stored in `dtype`. For `qwen2` and
    `qwen3`, take the tokenizer from "tiny-qwen2": transformers>=5 imposes Qwen2's pre-tokenizer
    on them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = resolve_model_path(tokenizer_from)
    for filename in _TOKENIZER_FILES:
        shutil.copyfile(source / filename, out / filename)
    source_config = json.loads((source / "config.json").read_text())
    defaults = {k: source_config.get(k) for k in ("vocab_size", "bos_token_id", "eos_token_id")}
    config = _build_config(arch, {**defaults, **config_kwargs}, dtype)
    _save_model_files(config, out, seed, shards, dtype)
    return out


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
