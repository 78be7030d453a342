"""Real HF checkpoint directories load: sharded safetensors, Mistral, Qwen2 bias, Qwen3 q/k norms
(and attention_bias), dtypes, dummy."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from common import LLM, SamplingParams
from common.models.llama import rope_inv_freq
from common.models.tiny import resolve_model_path, write_hf_checkpoint
from tests.engine.hf_reference import assert_same_greedy, hf_greedy, random_prompts

SMALL = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    vocab_size=1024,
)


@pytest.mark.parametrize(
    "arch, extra, shards",
    [
        ("mistral", {"sliding_window": None}, 3),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 2),
        ("qwen2", {"tie_word_embeddings": True}, 1),
        # head_dim wider than hidden / heads; attention_bias puts biases on q, k, v and o
        ("qwen3", {"head_dim": 32, "attention_bias": True, "tie_word_embeddings": True}, 2),
    ],
)
def test_sharded_checkpoint_matches_hf(tmp_path, arch, extra, shards):
    path = write_hf_checkpoint(tmp_path / arch, SMALL | extra, arch, seed=3, shards=shards)
    if shards > 1:
        assert (path / "model.safetensors.index.json").is_file()
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    llm = LLM(model=str(path), max_model_len=256, num_blocks=64)
    prompts = random_prompts(1024, 4, (3, 60), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert_same_greedy(hf, prompt, out.outputs[0].token_ids, hf_greedy(hf, prompt, 10))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_load_and_generate(dtype):
    llm = LLM(model="tiny-llama", dtype=dtype, max_model_len=256, num_blocks=64)
    assert llm.engine.runner.kv_cache.dtype == getattr(torch, dtype)
    out = llm.generate(
        [[5, 6, 7, 8]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 5


def test_dummy_load_format_needs_only_a_config(tmp_path):
    tiny = resolve_model_path("tiny-llama")
    for name in (
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ):
        (tmp_path / name).write_bytes((tiny / name).read_bytes())  # no weights
    llm = LLM(model=str(tmp_path), load_format="dummy", num_blocks=300)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_missing_weights_and_bad_arch_are_clear(tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", SMALL, "llama", seed=1)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(cfg | {"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(model=str(path), num_blocks=64, max_model_len=256)


def test_rope_parameters_of_transformers_5_configs():
    """Configs saved by transformers 5 carry rope settings only under ``rope_parameters``."""
    from common.models.llama import LlamaArgs

    base = {
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    scaling = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1234.0}
    args = LlamaArgs.from_hf(base | {"rope_parameters": scaling})
    assert args.rope_theta == 1234.0 and args.rope_scaling["rope_type"] == "linear"
    plain = LlamaArgs.from_hf(
        base | {"rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}
    )
    assert plain.rope_theta == 5.0 and plain.rope_scaling is None


def test_llama3_rope_scaling_matches_hf():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    got = rope_inv_freq(128, 500000.0, scaling)
    assert torch.allclose(got, want.float(), rtol=1e-6)
