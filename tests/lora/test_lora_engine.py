"""Multi-LoRA in the engine: one step mixing the base model and two adapters equals HF +
PEFT token for token; the prefix cache never crosses adapters; ``max_loras`` slots, least
recently used out; adapters the model cannot take are refused at admission; n > 1, beam search,
speculative decoding and structured outputs keep their tokens under an adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import LLM, SamplingParams
from common.beam_search import BeamSearchParams
from common.models.names import resolve_model_path
from tests.engine.hf_reference import hf_greedy, random_prompts
from tests.lora.adapters import peft_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ARGS = dict(enable_lora=True, max_loras=2, max_lora_rank=16, num_blocks=256)


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny-llama", **ARGS) as engine:
        yield engine


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_one_batch_of_base_and_two_adapters_equals_hf_peft(llm, adapter_dirs):
    model = resolve_model_path("tiny-llama")
    prompts = random_prompts(1000, 3, (5, 40), seed=3)
    names = [None, "alpha", "beta"]
    refs = {n: llm.lora(n, str(adapter_dirs[n])) for n in ("alpha", "beta")}
    batch = [(p, n) for p in prompts for n in names]  # every prompt under all three
    outs = llm.generate(
        [p for p, _ in batch], GREEDY, use_tqdm=False,
        lora_request=[refs[n] if n else None for _, n in batch],
    )  # fmt: skip
    got = dict(zip([(tuple(p), n) for p, n in batch], _tokens(outs)))
    for name in names:
        hf = peft_model(model, adapter_dirs[name] if name else None)
        for p in prompts:
            assert got[tuple(p), name] == hf_greedy(hf, p, 12), (name, p)
    for p in prompts:  # the adapters matter: the test could fail
        assert got[tuple(p), "alpha"] != got[tuple(p), None] != got[tuple(p), "beta"]
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks


def test_the_prefix_cache_never_crosses_adapters(llm, adapter_dirs):
    alpha = llm.lora("alpha", str(adapter_dirs["alpha"]))
    prompt = random_prompts(1000, 1, (64, 64), seed=9)[0]
    hashes = {}
    for lora in (alpha, None, alpha):
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        hashes.setdefault(lora, []).append((out.num_cached_tokens, out.outputs[0].token_ids))
    (cold, a_tokens), (warm, a_again) = hashes[alpha]
    [(base_cached, base_tokens)] = hashes[None]
    assert base_cached == 0 and cold == 0  # alpha's blocks are not the base model's
    assert warm == 48 and a_again == a_tokens  # its own are (3 full blocks of 16)
    assert base_tokens != a_tokens


def test_same_name_new_weights_is_a_new_identity(llm, adapter_dirs, tmp_path):
    changed = tmp_path / "alpha"
    shutil.copytree(adapter_dirs["alpha"], changed)
    weights = load_file(str(changed / "adapter_model.safetensors"))
    save_file({k: v * 2 for k, v in weights.items()}, str(changed / "adapter_model.safetensors"))
    old, new = llm.lora("alpha", str(adapter_dirs["alpha"])), llm.lora("alpha", str(changed))
    assert old.identity != new.identity
    prompt = random_prompts(1000, 1, (64, 64), seed=10)[0]
    llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=old)
    out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=new)[0]
    assert out.num_cached_tokens == 0
    hf = peft_model(resolve_model_path("tiny-llama"), changed)
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_one_slot_serves_two_adapters_in_turn(adapter_dirs):
    """max_loras=1: a step never holds two adapters; the scheduler takes them in turns and the
    slot is reloaded, least recently used out, with the tokens of two slots."""
    prompts = random_prompts(1000, 4, (5, 30), seed=4)
    with LLM("tiny-llama", **{**ARGS, "max_loras": 2}) as two:
        refs = [two.lora(n, str(adapter_dirs[n])) for n in ("alpha", "beta", "alpha", "beta")]
        want = _tokens(two.generate(prompts, GREEDY, use_tqdm=False, lora_request=refs))
    with LLM("tiny-llama", **{**ARGS, "max_loras": 1}) as one:
        refs = [one.lora(n, str(adapter_dirs[n])) for n in ("alpha", "beta", "alpha", "beta")]
        got = _tokens(one.generate(prompts, GREEDY, use_tqdm=False, lora_request=refs))
        manager = one.engine.runner.lora
        assert manager is not None and manager.num_loads >= 2 and len(manager.resident) == 1
    assert got == want


def _broken(adapter_dir, tmp_path, edit_config=None, edit_weights=None):
    out = tmp_path / "broken"
    shutil.copytree(adapter_dir, out)
    if edit_config:
        cfg = json.loads((out / "adapter_config.json").read_text())
        edit_config(cfg)
        (out / "adapter_config.json").write_text(json.dumps(cfg))
    if edit_weights:
        tensors = load_file(str(out / "adapter_model.safetensors"))
        save_file(edit_weights(tensors), str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize(
    ("edit_config", "edit_weights", "match"),
    [
        (lambda c: c.update(use_dora=True), None, "DoRA is not supported"),
        (lambda c: c.update(r=64), None, "over --max-lora-rank 16"),
        (lambda c: c.update(target_modules=["embed_tokens"]), None, "not supported"),
        (lambda c: c.update(bias="all"), None, "bias='all'"),
        (None, lambda t: {k: v[:, :-1].contiguous() if "lora_A" in k else v for k, v in t.items()},
         "the model needs"),
    ],
    ids=["dora", "rank", "embedding", "bias", "another-model"],
)  # fmt: skip
def test_an_adapter_the_model_cannot_take_is_refused_at_admission(
    llm, adapter_dirs, tmp_path, edit_config, edit_weights, match
):
    broken = _broken(adapter_dirs["alpha"], tmp_path, edit_config, edit_weights)
    with pytest.raises(ValueError, match=match):
        lora = llm.lora("broken", str(broken))
        llm.engine.add_request("bad", [5, 6, 7], GREEDY, lora=lora)
    assert not llm.engine.has_unfinished()
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_lora_off_refuses_an_adapter(adapter_dirs):
    with LLM("tiny-llama", num_blocks=256) as plain:
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.lora("alpha", str(adapter_dirs["alpha"]))
        from common.lora.adapter import read_adapter

        ref, _ = read_adapter("alpha", adapter_dirs["alpha"], 16)
        with pytest.raises(ValueError, match="LoRA is not enabled"):
            plain.engine.add_request("x", [5, 6], GREEDY, lora=ref)


def test_n_samples_and_beam_search_under_an_adapter(llm, adapter_dirs):
    beta = llm.lora("beta", str(adapter_dirs["beta"]))
    prompt = random_prompts(1000, 1, (20, 20), seed=5)[0]
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True)
    two = llm.generate([prompt], SamplingParams(**{**seeded.__dict__, "n": 2}), use_tqdm=False,
                       lora_request=beta)[0]  # fmt: skip
    assert len(two.outputs) == 2
    alone = llm.generate([prompt], seeded, use_tqdm=False, lora_request=beta)[0]
    assert alone.outputs[0].token_ids in [o.token_ids for o in two.outputs]
    base = llm.generate([prompt], seeded, use_tqdm=False)[0]
    assert base.outputs[0].token_ids != alone.outputs[0].token_ids
    beams = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=6),
                            use_tqdm=False, lora_request=beta)[0]  # fmt: skip
    hf = peft_model(resolve_model_path("tiny-llama"), adapter_dirs["beta"])
    with torch.no_grad():
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2,
                             do_sample=False, max_new_tokens=6, early_stopping=True,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
    assert beams.sequences[0].output_token_ids == theirs[0, len(prompt) :].tolist()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_an_adapters_tokens(adapter_dirs, method):
    spec = {"method": method, "num_speculative_tokens": 3}
    spec.update({"prompt_lookup_max": 3} if method == "ngram" else {"model": "tiny-llama"})
    repeat = [11, 12, 13, 14, 15, 16] * 6  # prompt lookup finds drafts in it
    prompts = [repeat, *random_prompts(1000, 2, (10, 30), seed=6)]
    with LLM("tiny-llama", **ARGS, speculative_config=spec) as spec_llm:
        alpha = spec_llm.lora("alpha", str(adapter_dirs["alpha"]))
        got = _tokens(spec_llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=alpha))
        assert spec_llm.engine.scheduler.spec_counts[1] > 0  # drafts were verified
    hf = peft_model(resolve_model_path("tiny-llama"), adapter_dirs["alpha"])
    assert got == [hf_greedy(hf, p, 12) for p in prompts]


def test_structured_output_under_an_adapter(llm, adapter_dirs):
    from common.sampling_params import StructuredOutputsParams

    alpha = llm.lora("alpha", str(adapter_dirs["alpha"]))
    params = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")
    )
    out = llm.generate(["Numbers:"], params, use_tqdm=False, lora_request=alpha)[0]
    text = out.outputs[0].text
    assert len(text) == 3 and text.isdigit(), text


def test_graph_shaped_decode_steps_apply_each_rows_adapter(adapter_dirs):
    """Decode steps through the CUDA-graph path (padded, fixed addresses; eager on a CPU) with
    base and adapter rows mixed give the tokens of eager steps."""
    from common.cuda_graphs import DecodeGraphs

    prompts = random_prompts(1000, 3, (10, 30), seed=14)
    outs = []
    for shaped in (False, True):
        with LLM("tiny-llama", **ARGS) as engine:
            runner = engine.engine.runner
            if shaped:
                runner.graphs = DecodeGraphs(
                    runner.model, runner.inputs, runner.block_size, [1, 2, 4],
                    max_seq_len=256, capture=False, lora=runner.lora,
                )  # fmt: skip
                runner.graphs.capture_all(runner.kv_layers)
            loras = [None, *(engine.lora(n, str(adapter_dirs[n])) for n in ("alpha", "beta"))]
            outs.append(
                _tokens(engine.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras))
            )
            if shaped:
                assert runner.graphs.replays > 0
    assert outs[0] == outs[1]


def test_a_moe_model_serves_attention_adapters_and_refuses_expert_ones(tmp_path):
    """tiny-mixtral: an adapter on the attention equals HF + PEFT; one whose tensors target a
    MoE layer's MLP (the experts) is refused at admission, saying so."""
    from safetensors.torch import save_file

    from tests.lora.adapters import write_adapter

    model = resolve_model_path("tiny-mixtral")
    attn = write_adapter(model, tmp_path / "attn", 5, r=8, lora_alpha=16,
                         target_modules=["q_proj", "o_proj"])  # fmt: skip
    prompts = random_prompts(500, 2, (5, 30), seed=15)
    with LLM("tiny-mixtral", enable_lora=True, num_blocks=256) as moe:
        out = moe.generate(prompts, GREEDY, use_tqdm=False, lora_request=moe.lora("a", str(attn)))
        hf = peft_model(model, attn)
        assert _tokens(out) == [hf_greedy(hf, p, 12) for p in prompts]
        experts = tmp_path / "experts"
        experts.mkdir()
        (experts / "adapter_config.json").write_text(
            json.dumps(
                {"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": ["down_proj"]}
            )
        )
        key = "base_model.model.model.layers.0.mlp.down_proj"
        save_file({f"{key}.lora_A.weight": torch.zeros(8, 128),
                   f"{key}.lora_B.weight": torch.zeros(128, 8)},
                  str(experts / "adapter_model.safetensors"))  # fmt: skip
        with pytest.raises(ValueError, match="targets a mixture-of-experts layer"):
            moe.engine.add_request("e", [5, 6, 7], GREEDY, lora=moe.lora("e", str(experts)))
