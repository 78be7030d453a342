"""The FP8 KV cache (``--kv-cache-dtype fp8``): e4m3 blocks in the paged cache and in every
store entry, per-layer scales from the checkpoint folded into the attention (K's into the
softmax scale, V's into the output), its own KV fingerprint (a cache of the model's dtype never
reads its entries: a mixed pool is refused at registration, and a forged handle is refused),
disaggregated == colocated token for token, swap preemption through the host tier and
speculative decoding keeping FP8 decoding's tokens."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from common import LLM, SamplingParams
from common.config import EngineConfig
from common.engine import EngineCore
from common.models.names import resolve_model_path
from kv_transfer.connector import create_store_connector, kv_fingerprint
from tests.kv_store.test_connector import params, prompts, run

FP8 = torch.float8_e4m3fn
ARGS = dict(model="tiny-llama", block_size=16, max_num_batched_tokens=256, num_blocks=256)
SCORE = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)


def _engine(
    url: str | None = None, role: str | None = None, staged: bool = False, **extra
) -> EngineCore:
    """``staged``: loads land through staging and a gather into the cache, as on CUDA."""
    config = EngineConfig.from_kwargs(**ARGS, kv_store=url, kv_role=role, **extra)
    factory = functools.partial(create_store_connector, read_in_place=not staged)
    return EngineCore(config, factory if url else None)


def test_the_cache_and_its_entries_take_one_byte_per_value():
    wide = LLM(model="tiny-llama", dtype="bfloat16", num_blocks=64, max_model_len=512).engine.runner
    fp8 = LLM(
        model="tiny-llama", dtype="bfloat16", num_blocks=64, max_model_len=512, kv_cache_dtype="fp8"
    )
    runner = fp8.engine.runner
    assert runner.kv_cache.dtype == FP8 and runner.model.embed_tokens.weight.dtype == torch.bfloat16
    assert runner.store_spec.bytes_per_block * 2 == wide.store_spec.bytes_per_block
    out = fp8.generate([[5, 6, 7, 8] * 10], params(8, True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    budget = dict(model="tiny-llama", dtype="bfloat16", kv_cache_memory_gb=0.02, max_model_len=512)
    blocks = [LLM(**budget, kv_cache_dtype=d).engine.runner.num_blocks for d in ("auto", "fp8")]
    assert blocks[1] in (2 * blocks[0], 2 * blocks[0] + 1)  # the same memory: twice the blocks
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        LLM(model="tiny-llama", kv_cache_dtype="fp8_e5m2")


@pytest.mark.parametrize(
    ("greedy", "store", "staged"),
    [(True, "file", False), (False, "file", False), (True, "shm", True)],
    ids=["greedy-file", "seeded-file", "greedy-shm-staged"],
)
def test_disaggregated_through_the_store_equals_colocated(tmp_path, greedy, store, staged):
    ps = prompts()
    url = f"{store}://{tmp_path}/kv"
    colocated = _engine(kv_cache_dtype="fp8")
    want = run(colocated, [(str(i), p, params(12, greedy), None) for i, p in enumerate(ps)])
    colocated.close()
    producer = _engine(url, "producer", kv_cache_dtype="fp8")
    first = run(producer, [(str(i), p, params(1, greedy), None) for i, p in enumerate(ps)])
    producer.close()
    consumer = _engine(url, "consumer", staged, kv_cache_dtype="fp8")
    rest = run(consumer, [
        (str(i), p, params(12, greedy), first[str(i)]["tokens"], first[str(i)]["handle"])
        for i, p in enumerate(ps)
    ])  # fmt: skip
    consumer.close()
    for i, p in enumerate(ps):
        key = str(i)
        assert first[key]["tokens"] + rest[key]["tokens"] == want[key]["tokens"]
        assert rest[key]["loaded"] == len(p)  # the whole prompt came from the store


def test_a_model_dtype_consumer_never_reads_fp8_entries(tmp_path):
    """Another fingerprint: the producer's handle is refused (another layout), and asked
    without one the store holds nothing under the consumer's fingerprint, so it recomputes (a
    pool mixing the two is refused at registration: every node shares one fingerprint)."""
    ps = prompts()
    url = f"file://{tmp_path}/kv"
    producer = _engine(url, "producer", kv_cache_dtype="fp8")
    first = run(producer, [(str(i), p, params(1, True), None) for i, p in enumerate(ps)])
    producer.close()
    wide = _engine(url, "consumer")
    handle = first["2"]["handle"]
    with pytest.raises(ValueError, match="KV handle is for another layout"):
        wide.add_request("forged", ps[2], params(4, True), output_token_ids=[7], kv_handle=handle)
    assert not wide.has_unfinished() and wide.num_free_blocks() == wide.runner.num_blocks
    rest = run(wide, [
        (str(i), p, params(4, True), first[str(i)]["tokens"]) for i, p in enumerate(ps)
    ])  # fmt: skip
    wide.close()
    assert all(r["loaded"] == 0 for r in rest.values())
    model = resolve_model_path("tiny-llama")
    assert kv_fingerprint(model, producer.runner.store_spec) != kv_fingerprint(
        model, wide.runner.store_spec
    )


def _scaled_checkpoint(out: Path, k_scale: float, v_scale: float, name: str) -> Path:
    """tiny-llama with per-layer KV scales, under ``name`` (``k_scale``, ``k_proj.k_scale``)."""
    src = resolve_model_path("tiny-llama")
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    layers = {int(k.split(".")[2]) for k in tensors if k.startswith("model.layers.")}
    for i in layers:
        for kind, value in (("k", k_scale), ("v", v_scale)):
            place = f"{kind}_proj.{kind}_scale" if name == "proj" else f"{kind}_scale"
            tensors[f"model.layers.{i}.self_attn.{place}"] = torch.tensor(value)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _prompt_logprobs(llm: LLM, ps: list[list[int]]) -> torch.Tensor:
    outs = llm.generate(ps, SCORE, use_tqdm=False)
    return torch.tensor([x.logprob for o in outs for x in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("name", ["attn", "proj"])
def test_checkpoint_scales_are_folded_into_the_attention(tmp_path, name):
    """The cache holds K / k_scale and V / v_scale (here K x 4, V x 2), and the attention reads
    it back to the same model within e4m3's rounding (0.01-0.03 nats); a scale left out of the
    softmax or the output moves the logprobs by ~2 nats. A model-dtype cache ignores them."""
    path = _scaled_checkpoint(tmp_path / "scaled", 0.25, 0.5, name)
    ps = prompts((40, 70, 90), seed=3)
    reference = LLM(model="tiny-llama", kv_cache_dtype="fp8")
    plain = _prompt_logprobs(reference, ps)
    llm = LLM(model=str(path), kv_cache_dtype="fp8")
    layers = [layer.self_attn for layer in llm.engine.runner.model.layers]
    assert all((a.k_scale, a.v_scale) == (0.25, 0.5) for a in layers)
    scaled = _prompt_logprobs(llm, ps)
    assert (scaled - plain).abs().mean() < 0.1, (scaled - plain).abs().mean()
    stored = [
        r.engine.runner.kv_cache.float().abs().sum(dim=(0, 2, 3, 4, 5)) for r in (llm, reference)
    ]
    ratio = stored[0] / stored[1]  # (K, V) magnitudes in the cache, scaled over plain
    assert 3.5 < ratio[0] < 4.5 and 1.8 < ratio[1] < 2.2, ratio
    for a in layers:  # what a read without k_scale would compute
        a.scale /= a.k_scale
    assert (_prompt_logprobs(llm, ps) - plain).abs().mean() > 1.0
    wide = LLM(model=str(path))  # no FP8 cache: the scales play no part
    assert torch.equal(_prompt_logprobs(wide, ps), _prompt_logprobs(LLM(model="tiny-llama"), ps))
    spec = llm.engine.runner.store_spec
    assert spec.kv_scales[:2] == (0.25, 0.5)
    assert kv_fingerprint(path, spec) != kv_fingerprint(path, reference.engine.runner.store_spec)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlapped"])
def test_swap_preemption_through_the_host_tier_keeps_fp8_tokens(overlap):
    """The host tier holds e4m3 blocks as the cache does: a cache too small for the batch swaps
    preempted requests out and back, and greedy and seeded tokens equal the unpreempted FP8
    run's with nothing computed twice."""
    from tests.engine.test_host_kv_tier import _swap_run

    args = {"kv_cache_dtype": "fp8", "async_scheduling": overlap}
    want, unpreempted = _swap_run(256, **args)
    got, swapped = _swap_run(30, kv_offload_gb=0.01, **args)
    assert swapped.engine.runner.host_tier.host.dtype == FP8
    assert got == want and swapped.engine.scheduler.num_preemptions > 0
    computed = swapped.engine.scheduler.num_scheduled_tokens
    assert computed == unpreempted.engine.scheduler.num_scheduled_tokens


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
        {"method": "draft_model", "model": "tiny-llama", "num_speculative_tokens": 3},
    ],
    ids=["ngram", "draft"],
)
def test_speculative_decoding_over_an_fp8_cache_keeps_its_tokens(spec):
    """Verification reads the drafts' K/V back from the FP8 cache as plain decoding reads its
    own (the draft model's cache is FP8 too): greedy and seeded tokens are plain FP8 decoding's."""
    ps = [[5, 6, 7, 8] * 10, prompts((50,), seed=4)[0]]
    sampling = [params(16, True), params(16, False)]
    args = dict(model="tiny-llama", kv_cache_dtype="fp8", max_model_len=256)
    plain = LLM(**args).generate(ps, sampling, use_tqdm=False)
    llm = LLM(**args, speculative_config=spec)
    got = llm.generate(ps, sampling, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
