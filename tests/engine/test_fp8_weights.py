"""FP8 weights (``common/models/fp8.py``): the W8A8 GEMM, ``--quantization fp8`` at load, FP8
checkpoints (per-channel and per-tensor scales) on one device and at TP 2, accuracy against the
unquantized model, and the KV fingerprint of a model quantized at load; FP8 MoE experts (both
checkpoint layouts, and at load) and block-wise scales (``common/models/fp8_blocks.py``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks.fp8_accuracy import compare
from common import LLM, SamplingParams
from common.models.fp8 import FP8, FP8_MAX, Fp8Linear, dequantize, fp8_matmul, quantize_rows
from common.models.fp8_blocks import expand_rows, quantize_blocks
from common.models.names import resolve_model_path

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], list(range(100, 140)), [3] * 30]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)


def test_the_gemm_is_the_dequantized_product_of_per_token_and_per_channel_e4m3():
    torch.manual_seed(0)
    x, w = torch.randn(7, 64), torch.randn(96, 64) * 0.02
    w8, scale = quantize_rows(w)
    assert w8.dtype == FP8 and scale.shape == (96, 1)
    dequant = w8.float() * scale
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of itself (relative), the row's
    # largest exactly at 448 · scale
    assert ((dequant - w).abs() <= w.abs() * 2**-4 + scale * 2**-9).all()
    assert torch.equal(w8.float().abs().amax(dim=1), torch.full((96,), FP8_MAX))
    x_scale = x.abs().amax(dim=1, keepdim=True) / FP8_MAX
    x8 = (x / x_scale).to(FP8).float() * x_scale
    torch.testing.assert_close(fp8_matmul(x, w8, scale), x8 @ dequant.t(), rtol=1e-5, atol=1e-6)
    assert fp8_matmul(x.view(1, 7, 64), w8, scale).shape == (1, 7, 96)  # leading dims kept


def test_quantization_at_load_makes_every_projection_fp8_and_stays_close():
    llm = LLM(model="tiny-llama", quantization="fp8")
    layer = llm.engine.runner.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert isinstance(proj, Fp8Linear) and proj.weight.dtype == FP8
    # the tiny random models have near-flat logits (any perturbation flips some argmaxes):
    # measured 0.50 / 0.96 nats (benchmarks/fp8_accuracy.py); a wrong scale or layout lands far
    # below (top-1 agreement of random logits: ~0.001)
    row = compare("tiny-llama", count=6, new_tokens=16)
    assert row["top1_agreement"] >= 0.4 and row["mean_abs_logprob_diff"] <= 1.3, row
    assert row["bytes_fp8"] * 3.8 < row["bytes"]  # fp32 projections → 1 byte + scales
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        LLM(model="tiny-llama", quantization="int4")


def _quantize(
    w: torch.Tensor, per_tensor: bool, block: tuple[int, int] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(…, out, in)`` → (e4m3, its scales as checkpoints hold them): per tensor (of each
    expert of a stacked tensor), per output channel ``(…, out, 1)``, or a block grid."""
    if block is not None:
        return quantize_blocks(w, block)
    if per_tensor:
        scale = (w.float().abs().amax(dim=(-2, -1)) / FP8_MAX).reshape(w.shape[:-2])
        return (w.float() / scale[..., None, None]).to(FP8), scale.contiguous()
    return quantize_rows(w)


def _is_projection(name: str) -> bool:
    """A decoder projection's or one expert's weight (not the router, norms, embeddings)."""
    return name.endswith(".weight") and any(
        f".{p}.weight" in name for p in (*PROJ, "w1", "w2", "w3")
    )


def _per_expert(name: str, w: torch.Tensor, mixtral: bool) -> dict[str, torch.Tensor]:
    """A stacked expert tensor as per-expert ones (vLLM's and compressed-tensors' layout)."""
    prefix, stacked = name.rsplit(".", 1)
    names = ("w1", "w3") if mixtral else ("gate_proj", "up_proj")
    if mixtral:
        prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
    if stacked == "down_proj":
        down = "w2" if mixtral else "down_proj"
        return {f"{prefix}.{e}.{down}.weight": w[e] for e in range(w.shape[0])}
    out = {}
    for e in range(w.shape[0]):
        for proj, rows in zip(names, w[e].chunk(2), strict=True):
            out[f"{prefix}.{e}.{proj}.weight"] = rows.contiguous()
    return out


def _fp8_checkpoint(
    out: Path,
    per_tensor: bool,
    model: str = "tiny-llama",
    block: tuple[int, int] | None = None,
    stacked: bool = True,
) -> Path:
    """``model`` with its projections (and MoE experts) in FP8, as vLLM's ``fp8`` checkpoints
    hold them: ``weight_scale`` per tensor or per channel, or with ``block`` a
    ``weight_scale_inv`` grid (DeepSeek / Qwen3-FP8); experts stacked as transformers 5 holds
    them (``experts.gate_up_proj`` + ``experts.gate_up_proj_scale(_inv)``) or, ``stacked=False``,
    per expert (``experts.{e}.w1.weight`` + ``.weight_scale(_inv)``)."""
    src = resolve_model_path(model)
    shutil.copytree(src, out)
    tensors = load_file(str(src / "model.safetensors"))
    suffix = "_scale_inv" if block is not None else "_scale"
    for name in list(tensors):
        if ".experts." in name and not stacked:
            tensors.update(_per_expert(name, tensors.pop(name), model == "tiny-mixtral"))
    for name in list(tensors):
        if not (_is_projection(name) or name.endswith(("experts.gate_up_proj", "down_proj"))):
            continue
        tensors[name], tensors[name + suffix] = _quantize(tensors[name], per_tensor, block)
        if name.endswith(".weight"):
            tensors[name.replace(".weight", ".input_scale")] = torch.ones(())  # unused: dynamic
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if block is not None:
        config["quantization_config"]["weight_block_size"] = list(block)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _run(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def test_a_per_channel_fp8_checkpoint_is_the_model_quantized_at_load(tmp_path):
    """The same e4m3 bytes and scales either way (splitting a fused projection's rows commutes
    with per-channel quantization): the same tokens and logprobs, to the bit."""
    path = _fp8_checkpoint(tmp_path / "fp8", per_tensor=False)
    loaded = LLM(model=str(path))
    qkv = loaded.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear)
    assert _run(loaded) == _run(LLM(model="tiny-llama", quantization="fp8"))


def test_a_per_tensor_fp8_checkpoint_fills_each_shard_with_its_scale(tmp_path):
    path = _fp8_checkpoint(tmp_path / "fp8", per_tensor=True)
    tensors = load_file(str(path / "model.safetensors"))
    llm = LLM(model=str(path))
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    q, k = (tensors[f"model.layers.0.self_attn.{p}_proj.weight_scale"] for p in "qk")
    n_q = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert torch.equal(qkv.weight_scale[:n_q], q.expand(n_q, 1))
    assert torch.equal(qkv.weight_scale[n_q : n_q + 1], k.reshape(1, 1))
    raw = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(qkv.weight[:n_q].view(torch.uint8), raw.view(torch.uint8))
    assert all(len(tokens) == 16 for tokens, _ in _run(llm))


def _teacher_forced(a: LLM, b: LLM) -> tuple[float, float]:
    """(top-1 agreement, mean |Δ logprob|) of two engines scoring ``a``'s greedy continuations."""
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seqs = [
        p + o.outputs[0].token_ids
        for p, o in zip(PROMPTS, a.generate(PROMPTS, greedy, use_tqdm=False))
    ]
    score = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    same, deltas = [], []
    for x, y in zip(
        a.generate(seqs, score, use_tqdm=False),
        b.generate(seqs, score, use_tqdm=False),
        strict=True,
    ):
        for u, v in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:], strict=True):
            same.append(u.top_ids[0] == v.top_ids[0])
            deltas.append(abs(u.logprob - v.logprob))
    return sum(same) / len(same), sum(deltas) / len(deltas)


@pytest.mark.parametrize("per_tensor", [False, True], ids=["per-channel", "per-tensor"])
def test_fp8_checkpoints_at_tp2_quantize_as_one_device(tmp_path, per_tensor):
    """A row-parallel projection's token scale is the max over every rank's slice, so TP 2
    rounds each activation as one device does; what is left is dense TP's summation order,
    which an e4m3 rounding boundary sometimes amplifies. Measured: top-1 0.99 / 0.95 and
    mean |Δ logprob| 0.007 / 0.057 (per-channel / per-tensor), against 0.78 / 0.58 and
    0.33 / 0.31 with each rank scaling its own slice (vLLM's way), and 0.50 / 0.96 between
    FP8 and the unquantized model."""
    path = str(_fp8_checkpoint(tmp_path / "fp8", per_tensor))
    args = dict(cpu_threads=1, num_blocks=64, block_size=8, max_model_len=256)
    single = LLM(model=path, **args)
    parallel = LLM(model=path, tensor_parallel_size=2, **args)
    try:
        top1, delta = _teacher_forced(single, parallel)
        assert top1 >= 0.9 and delta <= 0.1, (top1, delta)
    finally:
        parallel.engine.close()


def test_weights_quantized_at_load_have_their_own_kv_fingerprint(tmp_path):
    from kv_transfer.connector import kv_fingerprint

    plain = LLM(model="tiny-llama").engine.runner
    quantized = LLM(model="tiny-llama", quantization="fp8").engine.runner
    path = _fp8_checkpoint(tmp_path / "fp8", per_tensor=False)
    checkpoint = LLM(model=str(path)).engine.runner
    prints = {
        kv_fingerprint(resolve_model_path("tiny-llama"), plain.store_spec),
        kv_fingerprint(resolve_model_path("tiny-llama"), quantized.store_spec),
        kv_fingerprint(path, checkpoint.store_spec),  # its config names the quantization
    }
    assert len(prints) == 3


def test_up_and_the_nodes_take_the_flag():
    from launcher.cluster_config import ClusterConfig
    from node_frontend.options import NodeOptions
    from pdserve_cli import build_parser

    up = ClusterConfig.from_args(build_parser().parse_args(["up", "--quantization", "fp8"]))
    assert up.node_argv()[-2:] == ["--quantization", "fp8"]
    node = NodeOptions(model="tiny-llama", kv_store="file:///tmp/kv", port=0, quantization="fp8")
    config = node.engine_config("consumer")
    assert config.quantization == "fp8" and config.runner_config().quantization == "fp8"


def test_the_accuracy_script_writes_its_report_and_plot(tmp_path):
    from benchmarks.fp8_accuracy import main

    out, png = tmp_path / "fp8.json", tmp_path / "fp8.png"
    main(["--model", "tiny-llama", "--prompts", "2", "--new-tokens", "4", "--json", str(out),
          "--plot", str(png)])  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["model"] == "tiny-llama" and row["positions"] > 0 and png.stat().st_size > 0


# ----------------------------------------------------------------------------- FP8 MoE experts

MOE_ARGS = dict(num_experts=6, top_k=3, intermediate_size=64, renormalize=True, fp32_weights=True)


def _sparse_moe() -> torch.nn.Module:
    from common.models.moe import MoeArgs, SparseMoe

    torch.manual_seed(0)
    moe = SparseMoe(MoeArgs(**MOE_ARGS, sparse_layers=frozenset({0})), 64)  # type: ignore[arg-type]
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape) / 8)
    return moe.eval()


@pytest.mark.parametrize("block", [None, 32], ids=["per-channel", "block-32"])
def test_fp8_experts_are_their_dequantized_weights_in_both_cpu_paths(block):
    """4 tokens (12 assignments: the gathered path) and 30 (90: the grouped one): FP8 experts
    give, to the bit, what the same path gives over their dequantized weights, and stay close
    to the unquantized experts."""
    from common.models.moe import fused_experts, route

    moe, x = _sparse_moe(), {n: torch.randn(n, 64) for n in (4, 30)}
    with torch.inference_mode():
        want = {n: moe(v) for n, v in x.items()}
    experts = moe.experts
    originals = experts.gate_up_proj.data, experts.down_proj.data
    if block is None:
        experts.quantize_fp8()
    else:
        experts.use_block_scales(block)
        for name, w in zip(("gate_up_proj", "down_proj"), originals, strict=True):
            w8, grid = quantize_blocks(w, (block, block))
            setattr(experts, name, torch.nn.Parameter(w8, requires_grad=False))
            getattr(experts, f"{name}_scale").data.copy_(expand_rows(grid, w.shape[1], block))
    assert experts.gate_up_proj.dtype == FP8 and experts.scales is not None
    gate_up, down = experts.dequantized(torch.float32)
    with torch.inference_mode():
        for n, v in x.items():
            got = moe(v)
            weights, ids = route(moe.gate(v), moe.top_k, moe.renormalize, torch.float32)
            assert torch.equal(got, fused_experts(v, gate_up, down, weights, ids))
            # e4m3's 3 mantissa bits: ~3.6 % RMS per weight, through two projections
            assert (got - want[n]).norm() <= 0.08 * want[n].norm(), n


@pytest.mark.parametrize(
    ("model", "stacked"),
    [("tiny-mixtral", False), ("tiny-qwen3-moe", False), ("tiny-qwen3-moe", True)],
    ids=["mixtral-per-expert", "qwen3-moe-per-expert", "qwen3-moe-stacked"],
)
def test_a_per_channel_fp8_moe_checkpoint_is_the_model_quantized_at_load(tmp_path, model, stacked):
    """Experts per expert (vLLM's and compressed-tensors' layout; Mixtral's w1/w3/w2) or
    stacked (transformers 5's ``experts.gate_up_proj`` + ``_scale``): the same e4m3 bytes and
    scales as ``--quantization fp8`` gives the experts (per expert and output channel), so the
    same tokens and logprobs, to the bit."""
    path = _fp8_checkpoint(tmp_path / "fp8", per_tensor=False, model=model, stacked=stacked)
    loaded = LLM(model=str(path))
    experts = loaded.engine.runner.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj_scale.shape[-1] == 1
    assert _run(loaded) == _run(LLM(model=model, quantization="fp8"))


def test_per_tensor_expert_scales_fill_their_shards(tmp_path):
    path = _fp8_checkpoint(tmp_path / "fp8", per_tensor=True, model="tiny-mixtral", stacked=False)
    tensors = load_file(str(path / "model.safetensors"))
    llm = LLM(model=str(path))
    experts = llm.engine.runner.model.layers[0].mlp.experts
    name = "model.layers.0.block_sparse_moe.experts.2.{}.weight{}"
    w1, w3 = (tensors[name.format(w, "_scale")] for w in ("w1", "w3"))
    inter = experts.down_proj.shape[2]
    assert torch.equal(experts.gate_up_proj_scale[2, :inter], w1.expand(inter, 1))
    assert torch.equal(experts.gate_up_proj_scale[2, inter:], w3.expand(inter, 1))
    raw = tensors[name.format("w2", "")]
    assert torch.equal(experts.down_proj[2].view(torch.uint8), raw.view(torch.uint8))
    assert all(len(tokens) == 16 for tokens, _ in _run(llm))


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_quantization_at_load_makes_moe_experts_fp8_and_stays_close(model):
    """Measured 0.59 / 0.81 (tiny-mixtral) and 0.28 / 1.58 (tiny-qwen3-moe, whose dense twin
    tiny-qwen3 gives 0.38 / 1.13 and whose experts alone in FP8 0.83 / 0.26: the dense
    projections' W8A8 dominates on these near-flat random logits)."""
    llm = LLM(model=model, quantization="fp8")
    experts = llm.engine.runner.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8
    row = compare(model, count=6, new_tokens=16)
    top1, delta = {"tiny-mixtral": (0.4, 1.3), "tiny-qwen3-moe": (0.2, 2.0)}[model]
    assert row["top1_agreement"] >= top1 and row["mean_abs_logprob_diff"] <= delta, row
    assert row["bytes_fp8"] * 3.8 < row["bytes"]  # the experts' bytes shrink too


# ------------------------------------------------------------------------ block-wise scales


def test_block_wise_dequantization_scales_each_block():
    """Blocks that do not divide the weight (70 × 100 in 32 × 48 blocks): each element times its
    block's scale, within e4m3's rounding of the original."""
    torch.manual_seed(0)
    w = torch.randn(70, 100) * 0.02
    w8, grid = quantize_blocks(w, (32, 48))
    assert w8.dtype == FP8 and grid.shape == (3, 3)
    full = grid.repeat_interleave(32, 0)[:70].repeat_interleave(48, 1)[:, :100]
    deq = dequantize(w8, expand_rows(grid, 70, 32), 48, torch.float32)
    assert torch.equal(deq, w8.float() * full)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + full * 2**-9).all()


@pytest.mark.parametrize(
    ("model", "stacked"),
    [("tiny-llama", True), ("tiny-mixtral", False), ("tiny-qwen3-moe", True)],
    ids=["llama", "mixtral-per-expert", "qwen3-moe-stacked"],
)
def test_block_wise_fp8_checkpoints_load_and_stay_close(tmp_path, model, stacked):
    """32 × 32 blocks (``weight_block_size``, ``weight_scale_inv``): each projection holds its
    grid with the rows expanded, and computes with the dequantized weights (W8A16), so it is
    closer to the unquantized model than per-channel W8A8. Measured (top-1 / mean |Δ logprob|):
    0.61 / 0.63, 0.64 / 0.56 and 0.33 / 1.36 (per-channel W8A8 at load: 0.55 / 0.94, 0.59 /
    0.81, 0.28 / 1.58); a wrong scale or layout lands near 0.001."""
    path = _fp8_checkpoint(tmp_path / "fp8", False, model=model, block=(32, 32), stacked=stacked)
    llm = LLM(model=str(path))
    layer = llm.engine.runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    tensors = load_file(str(path / "model.safetensors"))
    grid = tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    n_q = tensors["model.layers.0.self_attn.q_proj.weight"].shape[0]
    assert isinstance(qkv, Fp8Linear) and qkv.block == 32
    assert torch.equal(qkv.weight_scale[:n_q], expand_rows(grid, n_q, 32))
    if model != "tiny-llama":
        experts = layer.mlp.experts
        assert experts.block == 32 and experts.gate_up_proj_scale.shape[-1] == 128 // 32
    row = compare(model, count=6, new_tokens=16, fp8_model=str(path))
    top1, delta = (0.25, 1.5) if model == "tiny-qwen3-moe" else (0.5, 0.8)
    assert row["top1_agreement"] >= top1 and row["mean_abs_logprob_diff"] <= delta, row


def test_block_wise_scales_under_tensor_parallelism_are_refused_in_one_line(tmp_path):
    from types import SimpleNamespace

    from common.attention import get_attention_backend
    from common.models.loader import build_model

    path = _fp8_checkpoint(tmp_path / "fp8", per_tensor=False, block=(32, 32))
    config = json.loads((path / "config.json").read_text())
    cpu = torch.device("cpu")
    backend = get_attention_backend("torch", cpu)
    tp = SimpleNamespace(size=2)
    with pytest.raises(ValueError, match="block-wise FP8 scales under tensor parallelism"):
        build_model(path, config, torch.float32, cpu, backend, 64, tp=tp)  # type: ignore[arg-type]
