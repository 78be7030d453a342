"""Built-in tiny models: offline generation, HF compatibility, determinism, race safety,
well-separated logits, and the sharded-checkpoint helper."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from common.cache_dir import publish
from common.models import tiny
from common.models.tiny import (
    TINY_MODELS,
    ensure_tiny_model,
    is_tiny_model,
    resolve_model_path,
    write_hf_checkpoint,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMES = sorted(TINY_MODELS)
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  two spaces, a tab\tand\nnew lines\n\n",
    "café, naïve, Zürich, 中文字符, こんにちは, emoji 😀🚀 👩‍💻 and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def _refuse_network(*args: object, **kwargs: object) -> None:
    raise OSError("network access attempted by an offline test")


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Both models generated once into a fresh cache, with every socket refused."""
    root = tmp_path_factory.mktemp("pdserve_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("PDSERVE_CACHE_DIR", str(root))
        mp.setattr(socket.socket, "connect", _refuse_network)
        mp.setattr(socket, "getaddrinfo", _refuse_network)
        for name in NAMES:
            ensure_tiny_model(name)
        yield root


def _model_dir(root: Path, name: str) -> Path:
    return root / "models" / f"{name}-v1"


def _run_python(code: str, cache: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PDSERVE_CACHE_DIR": str(cache)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["PYTHONHASHSEED"] = "random"  # nothing may depend on Python's hash order
    cmd = [sys.executable, "-c", code, *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _greedy_logits(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy-decode `steps` tokens with HF; return the logits of every step, (steps, V)."""
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=steps,
        min_new_tokens=steps,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return torch.cat(out.logits)


# ------------------------------------------------------------------------------- generation


@pytest.mark.parametrize("name", NAMES)
def test_generated_dir_loads_in_transformers(cache_root: Path, name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = _model_dir(cache_root, name)
    for filename in ("config.json", "generation_config.json", "model.safetensors"):
        assert (model_dir / filename).is_file()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] % 64 == 0 and len(tokenizer) <= config["vocab_size"] < 2048
    assert config["torch_dtype"] == "float32" and "rope_theta" in config
    assert model.config.architectures == [f"{type(model).__name__}"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    ids = torch.tensor([tokenizer.encode(TEXTS[0])])
    assert model(ids).logits.shape == (1, ids.shape[1], config["vocab_size"])


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_round_trips_and_agrees_with_raw_tokenizers(cache_root: Path, name: str) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    model_dir = _model_dir(cache_root, name)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    raw = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert raw.encode(text).ids == ids  # every reader of the directory sees the same ids
    assert 1000 <= len(tokenizer) <= 2048
    first = tokenizer.encode("hi")[0]
    if TINY_MODELS[name].specials_first:  # tiny-llama's tokenizer (tiny-mixtral's too)
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id, first) == (1, 2, 1)
    else:
        assert tokenizer.bos_token_id is None and first not in tokenizer.all_special_ids
        assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("name", NAMES)
def test_chat_template(cache_root: Path, name: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(_model_dir(cache_root, name))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = {
        "tiny-llama": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.</s>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi</s>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "tiny-qwen2": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n",
    }
    expected["tiny-qwen3"] = expected["tiny-qwen3-moe"] = expected["tiny-qwen2"]
    expected["tiny-mixtral"] = expected["tiny-llama"]
    assert text == expected[name]
    markers = {"tiny-llama": ("<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>")}
    markers["tiny-mixtral"] = markers["tiny-llama"]
    for marker in markers.get(name, ("<|im_start|>", "<|im_end|>")):
        [token_id] = tokenizer.encode(marker, add_special_tokens=False)  # one token each
        assert token_id in tokenizer.all_special_ids


class RaceResult(NamedTuple):
    cache: Path
    returncodes: list[int]
    stdouts: list[str]
    stderrs: list[str]


_RACE_SCRIPT = """
import logging, pathlib, sys, time
from common.models.tiny import ensure_tiny_model
import transformers, transformers.models.llama, transformers.models.qwen2  # slow imports first
import transformers.models.qwen3, transformers.models.mixtral, transformers.models.qwen3_moe
logging.basicConfig(level=logging.INFO)
pathlib.Path(sys.argv[1]).touch()
while not pathlib.Path(sys.argv[2]).exists():
    time.sleep(0.005)
for name in sys.argv[3:]:
    print(ensure_tiny_model(name))
"""


@pytest.fixture(scope="module")
def raced_cache(tmp_path_factory: pytest.TempPathFactory) -> RaceResult:
    """Two fresh processes generate both models into one empty cache, released together."""
    base = tmp_path_factory.mktemp("race")
    cache, go = base / "cache", base / "go"
    ready = [base / f"ready{i}" for i in range(2)]
    procs = [_run_python(_RACE_SCRIPT, cache, str(r), str(go), *NAMES) for r in ready]
    deadline = time.monotonic() + 60
    while not all(r.exists() for r in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    outputs = [p.communicate(timeout=120) for p in procs]
    return RaceResult(
        cache, [p.returncode for p in procs], [o for o, _ in outputs], [e for _, e in outputs]
    )


def test_concurrent_generation_both_end_with_complete_dir(raced_cache: RaceResult) -> None:
    assert raced_cache.returncodes == [0, 0], raced_cache.stderrs
    targets = [_model_dir(raced_cache.cache, name) for name in NAMES]
    expected = "".join(f"{t}\n" for t in targets)
    assert raced_cache.stdouts == [expected, expected]
    for stderr in raced_cache.stderrs:  # neither found a finished dir: a real race
        assert f"generating built-in model {NAMES[0]} " in stderr, stderr
    leftovers = sorted(p.name for p in (raced_cache.cache / "models").iterdir())
    assert leftovers == sorted(t.name for t in targets)  # the losers' temp dirs are gone
    assert all(tiny._is_complete(t) and (t / "model.safetensors").is_file() for t in targets)


def test_generation_is_deterministic_across_processes(
    cache_root: Path, raced_cache: RaceResult
) -> None:
    for name in NAMES:
        first, second = _model_dir(cache_root, name), _model_dir(raced_cache.cache, name)
        names = sorted(p.name for p in first.iterdir())
        assert names == sorted(p.name for p in second.iterdir())
        for filename in names:  # weights and tokenizer.json above all, but every file holds
            assert (first / filename).read_bytes() == (second / filename).read_bytes(), filename


def test_publish_loser_keeps_winners_copy(cache_root: Path) -> None:
    target = _model_dir(cache_root, "tiny-llama")
    before = (target / "model.safetensors").read_bytes()
    loser = target.parent / ".tiny-llama-v1.tmp-loser"
    loser.mkdir()
    (loser / "config.json").write_text("{}")
    assert publish(loser, target, tiny._is_complete) == target
    assert not loser.exists()
    assert (target / "model.safetensors").read_bytes() == before


def test_resolve_model_path(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache_root))
    assert is_tiny_model("tiny-llama") and not is_tiny_model("llama")
    llama_dir = resolve_model_path("tiny-llama")
    assert llama_dir == _model_dir(cache_root, "tiny-llama")
    assert resolve_model_path(str(llama_dir)) == llama_dir
    for bad in ("tiny-gpt", str(tmp_path), str(tmp_path / "missing")):
        with pytest.raises(ValueError, match=r"not a built-in model .* not a directory"):
            resolve_model_path(bad)
    with pytest.raises(ValueError, match="not a built-in model"):
        ensure_tiny_model("tiny-gpt")


# ------------------------------------------------------------------------------------ logits


@pytest.mark.parametrize("name", NAMES)
def test_greedy_logits_are_well_separated_and_diverse(cache_root: Path, name: str) -> None:
    """Engine-vs-HF greedy comparisons need top-1/top-2 gaps far above fp32 noise (~1e-5), and
    a continuation that does not collapse into one repeated token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(_model_dir(cache_root, name)).eval()
    generator = torch.Generator().manual_seed(0)
    gaps, distinct = [], []
    for _ in range(2):
        prompt = torch.randint(0, 1000, (1, 8), generator=generator)
        logits = _greedy_logits(model, prompt, steps=48)
        top2 = logits.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        distinct.append(len(set(logits.argmax(-1).tolist())))
    all_gaps = torch.cat(gaps)
    assert (all_gaps < 1e-3).sum() <= 1, all_gaps.sort().values[:5]
    assert all_gaps.min() > 1e-5
    assert min(distinct) >= 24, distinct


# --------------------------------------------------------------------------- HF checkpoints

_SMALL = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2)


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", dict(num_key_value_heads=1, head_dim=32)),
        ("mistral", dict(num_key_value_heads=1, head_dim=32, sliding_window=None)),
        ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=True)),
        ("qwen3", dict(num_key_value_heads=1, head_dim=48, tie_word_embeddings=True)),
        ("mixtral", dict(num_key_value_heads=1, num_local_experts=4, sliding_window=None)),
        (
            "qwen3_moe",
            dict(
                num_key_value_heads=1,
                moe_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        ),
    ],
)
def test_sharded_checkpoint_loads_with_same_logits(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arch: str, extra: dict
) -> None:
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache_root))
    kwargs = {**_SMALL, **extra}
    single = write_hf_checkpoint(tmp_path / "single", kwargs, arch, seed=7)  # type: ignore[arg-type]
    sharded = write_hf_checkpoint(tmp_path / "sharded", kwargs, arch, seed=7, shards=3)  # type: ignore[arg-type]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_files = {f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)}
    assert set(index["weight_map"].values()) == shard_files
    assert all((sharded / f).is_file() for f in shard_files)
    assert not (sharded / "model.safetensors").exists()
    ids = torch.tensor([[1, 100, 200, 300, 400, 500]])
    logits = []
    for model_dir in (single, sharded):
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        # weights in fresh storage: read in place from the files, their addresses differ in
        # alignment between the two checkpoints, and CPU GEMMs round by alignment (Mixtral's
        # logits came out 3e-6 apart with equal weights; cloned, bit for bit)
        for param in model.parameters():
            param.data = param.data.clone()
        assert model.config.model_type == arch
        logits.append(model(ids).logits)
    assert torch.equal(logits[0], logits[1])


def test_checkpoint_dtype_is_stored(
    cache_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors import safe_open

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(cache_root))
    out = write_hf_checkpoint(
        tmp_path / "bf16", dict(_SMALL), "llama", seed=1, dtype=torch.bfloat16
    )
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
