"""Mixture-of-experts models (Mixtral, Qwen3-MoE): the sparse MLP against transformers' own
blocks, both checkpoint layouts, greedy equal to HF in the engine (built-in tiny models and
hold-out directories written with transformers), the tensor-parallel refusal, and the ops of a
MoE layer in a decode step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from common import LLM, SamplingParams
from common.attention import get_attention_backend
from common.models.loader import build_model
from common.models.moe import (
    GATHER_MAX_ASSIGNMENTS,
    MoeArgs,
    SparseMoe,
    combine_slots,
    expert_slots,
    fused_experts,
    route,
)
from common.models.preflight import check_tensor_parallel
from common.models.tiny import resolve_model_path, write_hf_checkpoint
from tests.engine.hf_reference import assert_same_greedy, hf_greedy, random_prompts
from tests.engine.test_step_ops import OpCounter, decode_step_ops, model_with_layers, per_layer

HIDDEN = 64
BLOCKS = {  # name → (HF config, HF block); expert widths multiples of 32 (see the note below)
    "mixtral-6e-top3": (
        MixtralConfig(
            hidden_size=HIDDEN, intermediate_size=96, num_local_experts=6, num_experts_per_tok=3
        ),
        MixtralSparseMoeBlock,
    ),
    "qwen3-moe-6e-top3": (
        Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
        ),
        Qwen3MoeSparseMoeBlock,
    ),
    "qwen3-moe-8e-top2-norm": (
        Qwen3MoeConfig(
            hidden_size=HIDDEN,
            moe_intermediate_size=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        ),
        Qwen3MoeSparseMoeBlock,
    ),
}
# NOTE: pdserve's native silu_and_mul differs from torch's silu(gate) * up by one ulp in the
# last columns of a row whose width is not a multiple of 32 (kernels/, seen here): exact
# equality below holds for the expert widths real models have (multiples of 32).


def _blocks(name: str, dtype: torch.dtype, experts_impl: str) -> tuple[torch.nn.Module, SparseMoe]:
    """HF's block (random weights) and ours holding the same weights."""
    config, block_cls = BLOCKS[name]
    config._experts_implementation = experts_impl
    torch.manual_seed(0)
    hf = block_cls(config)
    with torch.no_grad():
        for param in hf.parameters():
            param.copy_(torch.randn(param.shape) / 8)
    hf = hf.to(dtype).eval()
    arch = type(config).__name__.replace("Config", "ForCausalLM")
    args = MoeArgs.from_hf(config.to_dict() | {"num_hidden_layers": 1}, arch)
    assert args is not None
    ours = SparseMoe(args, HIDDEN).to(dtype)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
    return hf, ours


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (restored after). A multi-threaded CPU GEMM splits its
    work by the matrix sizes, and transformers' grouped GEMM and our per-expert linears have
    different sizes, so at 2 threads their fp32 sums were seen to round apart (by an ulp, in 19
    of 37 rows) while at 1 they are bit-equal: which GEMM blocking runs is the machine's choice,
    not a rounding point of the block. (Run in the whole suite, an earlier engine had already
    set one thread for the process: the test passed there and failed alone.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_sparse_moe_equals_transformers_block_bit_for_bit(name, dtype, one_thread):
    """Against transformers' default experts path (``grouped_mm``, what ``from_pretrained``
    picks): the same rounding points, so the same bits in fp32 and bf16."""
    hf, ours = _blocks(name, dtype, "grouped_mm")
    x = torch.randn(1, 37, HIDDEN).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x[0]), hf(x)[0])


@pytest.mark.parametrize("name", list(BLOCKS))
def test_sparse_moe_agrees_with_transformers_eager_experts(name):
    """transformers' eager experts loop sums the k experts in expert order (index_add_) rather
    than in slot order: the same function, fp32 reassociation apart."""
    hf, ours = _blocks(name, torch.float32, "eager")
    x = torch.randn(1, 37, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(ours(x[0]), hf(x)[0], rtol=1e-5, atol=1e-6)


def test_route_normalises_per_architecture():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.bfloat16)
    probs = torch.softmax(logits.float(), dim=-1)
    # Mixtral: renormalised, fp32
    weights, ids = route(logits, 2, renormalize=True, weights_dtype=torch.float32)
    assert ids.tolist() == [[0, 1]] and weights.dtype == torch.float32
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum(), rtol=0, atol=0)
    # Qwen3-MoE without norm_topk_prob: the softmax probabilities, cast to the model dtype
    weights, ids = route(logits, 2, renormalize=False, weights_dtype=torch.bfloat16)
    assert weights.dtype == torch.bfloat16
    assert torch.equal(weights, probs[:, :2].to(torch.bfloat16))


def test_ops_of_the_sparse_mlp_are_fixed_when_gathered_and_five_per_expert_hit_when_grouped():
    """Up to ``GATHER_MAX_ASSIGNMENTS`` (token, expert) assignments (here 32 tokens × top 2):
    one op, ``kernels/moe_cpu.py``'s native call (router to weighted sum); the same path in
    PyTorch (``fused_experts``' gathered path, which FP8 experts and expert parallelism take)
    is 12 whatever the experts hit (router, softmax, top-k, sum, div, two gathers, two
    einsums, silu_and_mul, two views). Neither reads the device on the host. Beyond: 20 ops
    (router, routing, grouping, the weighted sum), then 5 per expert that has tokens (two
    selects, two linears, silu_and_mul): a loop over experts, never over tokens."""
    _, ours = _blocks("qwen3-moe-8e-top2-norm", torch.float32, "grouped_mm")
    for tokens in (1, 3, 32, 33, 64):
        x = torch.randn(tokens, HIDDEN)
        with torch.inference_mode():  # as the engine runs: linear stays one op
            hit = len(route(ours.gate(x), 2, True, torch.float32)[1].unique())
            with OpCounter() as counter:
                ours(x)
            with OpCounter() as gathered:
                weights, ids = route(ours.gate(x), 2, True, torch.float32)
                fused_experts(x, ours.experts.gate_up_proj, ours.experts.down_proj, weights, ids)
        if tokens * 2 <= GATHER_MAX_ASSIGNMENTS:
            assert dict(counter.ops) == {"pdserve.moe_decode": 1}
            assert sum(gathered.ops.values()) == 12, dict(gathered.ops)
            assert not gathered.ops["aten.bincount"] and not gathered.ops["aten.resolve_conj"]
        else:
            assert sum(counter.ops.values()) == 20 + 5 * hit, dict(counter.ops)
            assert counter.ops["pdserve.silu_and_mul"] == hit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(BLOCKS))
def test_the_gathered_path_agrees_with_the_grouped_path_and_transformers(name, dtype):
    """The gathered path's batched matrix-vector products sum in another order than the
    grouped GEMMs: fp32 reassociation apart (bf16: an ulp of the output here and there)."""
    hf, ours = _blocks(name, dtype, "grouped_mm")
    experts, k = ours.experts, ours.top_k
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for tokens in (1, 8, GATHER_MAX_ASSIGNMENTS // k):
        x = torch.randn(tokens, HIDDEN).to(dtype)
        with torch.inference_mode():
            logits = ours.gate(x)
            weights, ids = route(logits, k, ours.renormalize, torch.float32 if ours.fp32_weights
                                 else dtype)  # fmt: skip
            args = (experts.gate_up_proj, experts.down_proj)
            gathered = fused_experts(x, *args, weights, ids)
            slots = expert_slots(x, *args, ids, 0, ours.num_experts)
            grouped = combine_slots(slots, weights, dtype)
            torch.testing.assert_close(gathered, grouped, **tol)
            torch.testing.assert_close(ours(x), hf(x[None])[0], **tol)


@pytest.mark.parametrize("name", list(BLOCKS))
def test_expert_parallel_shares_on_the_cpu_are_the_one_device_result(name):
    """Two ranks in one process, each holding half of the experts: their slots summed (the
    group's all-reduce) give one device's PyTorch output to the bit, on the gathered path (4
    and 8 tokens) and the grouped one (40 tokens: over 64 assignments). (One device's decode
    steps take the native call, ``kernels/moe_cpu.py``, equal to these to fp32
    reassociation: ``tests/kernels/test_moe_cpu.py``.)"""
    _, one = _blocks(name, torch.float32, "grouped_mm")
    config = BLOCKS[name][0]
    arch = type(config).__name__.replace("Config", "ForCausalLM")
    args = MoeArgs.from_hf(config.to_dict() | {"num_hidden_layers": 1}, arch)
    assert args is not None
    half = one.num_experts // 2
    shares: dict[int, torch.Tensor] = {}
    ranks = []
    for r in (0, 1):
        ep = SimpleNamespace(split=lambda n, r=r: (r * half, (r + 1) * half))
        rank = SparseMoe(args, HIDDEN, ep)  # type: ignore[arg-type]
        with torch.no_grad():
            rank.gate.weight.copy_(one.gate.weight)
            rank.experts.gate_up_proj.copy_(one.experts.gate_up_proj[r * half : (r + 1) * half])
            rank.experts.down_proj.copy_(one.experts.down_proj[r * half : (r + 1) * half])
        ranks.append(rank)
    for tokens in (4, 8, 40):
        x = torch.randn(tokens, HIDDEN)
        with torch.inference_mode():
            for r, rank in enumerate(ranks):  # each rank's share, then the sum as all-reduce
                rank.ep.all_reduce = lambda slots, r=r: shares.__setitem__(r, slots) or slots
                rank(x)
            weights, ids = route(one.gate(x), one.top_k, one.renormalize, _weights_dtype(one))
            want = fused_experts(x, one.experts.gate_up_proj, one.experts.down_proj, weights, ids)
            for rank in ranks:
                rank.ep.all_reduce = lambda slots: shares[0] + shares[1]
                assert torch.equal(rank(x), want), tokens


def _weights_dtype(moe: SparseMoe) -> torch.dtype:
    return torch.float32 if moe.fp32_weights else moe.gate.weight.dtype


# ------------------------------------------------------------------------- checkpoint layouts

SMALL = dict(
    hidden_size=64,
    intermediate_size=96,  # Qwen3-MoE: the dense layers' width
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    vocab_size=1024,
)
HOLD_OUT = {  # 6 experts, top 3: neither tiny model's count; one dense layer in Qwen3-MoE
    "mixtral": (SMALL | dict(num_local_experts=6, num_experts_per_tok=3), "tiny-llama"),
    "qwen3_moe": (
        SMALL
        | dict(
            moe_intermediate_size=64,
            num_experts=6,
            num_experts_per_tok=3,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
        "tiny-qwen2",
    ),
}


def _hold_out(tmp_path: Path, arch: str) -> tuple[Path, Path]:
    """The same random model twice: experts stacked as transformers 5 holds them (our writer
    saves the state dict), and per expert as ``save_pretrained`` (and the Hub) writes them."""
    config, tokenizer = HOLD_OUT[arch]
    out = tmp_path / f"{arch}-fused"
    fused = write_hf_checkpoint(out, config, arch, seed=11, shards=2, tokenizer_from=tokenizer)
    per_expert = tmp_path / f"{arch}-per-expert"
    loaded = AutoModelForCausalLM.from_pretrained(str(fused))
    # a model loaded from stacked experts saves them stacked again; one built from its config
    # saves them per expert, the Hub's layout
    model = AutoModelForCausalLM.from_config(loaded.config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(per_expert)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(fused / name, per_expert / name)
    return fused, per_expert


def _tensor_names(model_dir: Path) -> set[str]:
    names: set[str] = set()
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    config = json.loads((model_dir / "config.json").read_text())
    backend = get_attention_backend("torch", torch.device("cpu"))
    model = build_model(model_dir, config, torch.float32, torch.device("cpu"), backend, 64)
    return dict(model.named_parameters())


@pytest.mark.parametrize("arch", list(HOLD_OUT))
def test_both_expert_layouts_load_the_same_weights(tmp_path, arch):
    fused, per_expert = _hold_out(tmp_path, arch)
    stacked, one = {
        "mixtral": ("model.layers.0.mlp.experts.gate_up_proj", "block_sparse_moe.experts.5.w3"),
        "qwen3_moe": ("model.layers.0.mlp.experts.gate_up_proj", "mlp.experts.5.up_proj"),
    }[arch]
    assert stacked in _tensor_names(fused)
    assert f"model.layers.0.{one}.weight" in _tensor_names(per_expert)
    a, b = _load(fused), _load(per_expert)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)
    if arch == "qwen3_moe":  # mlp_only_layers=[1]: a dense MLP there, experts elsewhere
        assert "layers.1.mlp.gate_up_proj.weight" in a and "layers.1.mlp.experts.down_proj" not in a
        assert "layers.2.mlp.experts.down_proj" in a


def test_a_missing_expert_is_named(tmp_path):
    _, per_expert = _hold_out(tmp_path, "qwen3_moe")
    path = per_expert / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.2.mlp.experts.4.down_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing weights: \['layers.2.mlp.experts.down_proj'"):
        _load(per_expert)


def test_tensor_parallelism_without_expert_parallelism_is_refused_in_one_line():
    config = json.loads((resolve_model_path("tiny-mixtral") / "config.json").read_text())
    check_tensor_parallel(config, 1)
    with pytest.raises(ValueError, match="MixtralForCausalLM shards its experts across ranks"):
        check_tensor_parallel(config, 2)
    check_tensor_parallel(config, 2, expert_parallel=True)
    with pytest.raises(ValueError, match="4 experts cannot be sharded over 8 ranks"):
        check_tensor_parallel(config, 8, expert_parallel=True)
    dense = json.loads((resolve_model_path("tiny-llama") / "config.json").read_text())
    check_tensor_parallel(dense, 2)
    backend = get_attention_backend("torch", torch.device("cpu"))
    with pytest.raises(ValueError, match="enable-expert-parallel"):  # the engine's ranks too
        cpu, tp = torch.device("cpu"), SimpleNamespace(size=2)
        build_model(Path("unused"), config, torch.float32, cpu, backend, 64, tp=tp)  # type: ignore[arg-type]


def test_up_refuses_a_moe_model_at_tensor_parallel_size_2_without_expert_parallelism():
    from launcher.cluster_config import ClusterConfig, check_model
    from pdserve_cli import build_parser

    def config(*argv: str) -> ClusterConfig:
        return ClusterConfig.from_args(build_parser().parse_args(["up", *argv]))

    assert check_model(config("--model", "tiny-qwen3-moe")).startswith("Qwen3MoeForCausalLM")
    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM shards its experts across"):
        check_model(config("--model", "tiny-qwen3-moe", "--decode-tp", "2"))
    ep = config("--model", "tiny-qwen3-moe", "--decode-tp", "2", "--enable-expert-parallel")
    assert check_model(ep).startswith("Qwen3MoeForCausalLM")
    assert "--enable-expert-parallel" in ep.node_argv()


# ------------------------------------------------------------------------------ greedy vs HF

MAX_NEW = 16
MODES = {
    "default": {},
    "chunked_preemption": {"max_num_batched_tokens": 48, "num_blocks": 24, "max_model_len": 256},
}


@pytest.fixture(scope="module", params=["tiny-mixtral", "tiny-qwen3-moe"])
def tiny_reference(request):
    path = resolve_model_path(request.param)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = random_prompts(hf.config.vocab_size, 6, (1, 100), seed=1)
    shared = random_prompts(hf.config.vocab_size, 1, (40, 40), seed=2)[0]
    prompts[3:] = [shared + p for p in prompts[3:]]  # prefix-cache hits
    return request.param, prompts, hf, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_moe_greedy_matches_hf(tiny_reference, mode):
    name, prompts, hf, expected = tiny_reference
    llm = LLM(model=name, block_size=16, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, want in zip(prompts, outputs, expected):
        assert_same_greedy(hf, prompt, out.outputs[0].token_ids, want)
    if mode == "chunked_preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    llm.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.runner.num_blocks


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(HOLD_OUT))
def test_hold_out_moe_matches_hf_in_both_layouts(tmp_path, arch):
    fused, per_expert = _hold_out(tmp_path, arch)
    hf = AutoModelForCausalLM.from_pretrained(str(per_expert), dtype=torch.float32).eval()
    prompts = random_prompts(1024, 4, (3, 60), seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    tokens = []
    for model_dir in (fused, per_expert):
        llm = LLM(model=str(model_dir), max_model_len=256, num_blocks=64)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outputs])
    assert tokens[0] == tokens[1]
    for prompt, ours in zip(prompts, tokens[0]):
        assert_same_greedy(hf, prompt, ours, hf_greedy(hf, prompt, 10))


# ------------------------------------------------------------------------ ops per decode step


def test_moe_layer_ops_per_decode_step(tmp_path):
    """Counted as ``test_step_ops`` counts the dense layer's (a 6-layer minus a 2-layer
    tiny-mixtral, over 4): 8 per layer = the dense layer's 7 ops outside its MLP + the sparse
    MLP's one native call, whatever the 8 decoding tokens' experts (it was 47 with all 4
    experts hit: 20 fixed + 5 per expert, then 19 with the gathered path in PyTorch); no host
    read."""
    models = {n: model_with_layers(tmp_path, n, "tiny-mixtral") for n in (2, 6)}
    ops = {n: decode_step_ops(model) for n, model in models.items()}
    diff = per_layer(ops)
    assert diff["pdserve.moe_decode"] == 4  # one per layer, whatever the experts hit
    assert sum(diff.values()) == 4 * 8, dict(diff)
    assert not any(diff[op] for op in ("aten.bincount", "aten.resolve_conj")), dict(diff)
    assert not any(diff[op] for op in ("aten.nonzero", "aten._local_scalar_dense")), dict(diff)
    assert decode_step_ops(models[6]) == ops[6]  # stable: the same ops in a second engine


# ------------------------------------------------------------------------ the benchmark shape


def test_the_moe_benchmark_shape_is_qwen3_30b_a3b():
    """``--shape qwen3-30b-a3b`` (``common/models/shapes.py``): built on ``meta``, 30.5 B
    parameters of which 3.3 B are active per token (8 of 128 experts), as Qwen publishes.
    (One layer of it, dummy weights, generates on the CPU in ~18 s: a benchmark's business.)"""
    from common.models.llama import LlamaArgs
    from common.models.loader import build_on_meta, read_hf_config
    from common.models.shapes import write_dummy_shape

    args = LlamaArgs.from_hf(read_hf_config(write_dummy_shape("qwen3-30b-a3b")))
    assert args.moe is not None and args.moe.num_experts == 128 and args.moe.top_k == 8
    model = build_on_meta(args, None, 8192, None)  # type: ignore[arg-type]
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * 8 // 128
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9  # 3.35 B


# ------------------------------------------------------------------- disaggregated == colocated


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_moe_disaggregated_equals_colocated(tmp_path, greedy):
    """tiny-qwen3-moe through the store connector as the nodes run it: a producer engine
    prefills and saves, a consumer loads the prompt's KV (nothing recomputed) and goes on; the
    tokens equal one colocated engine's. The KV is the attention's, so MoE changes nothing in
    the store's entries."""
    from common.config import EngineConfig
    from common.engine import EngineCore
    from kv_transfer.connector import create_store_connector
    from tests.kv_store.test_connector import PROMPT_LENS, params, prompts, run

    url = f"file://{tmp_path}/kv"
    args = dict(model="tiny-qwen3-moe", block_size=16, max_num_batched_tokens=256, num_blocks=256)

    def engine(role: str | None = None) -> EngineCore:
        config = EngineConfig.from_kwargs(**args, kv_store=url if role else None, kv_role=role)
        return EngineCore(config, create_store_connector if role else None)

    ps = prompts()
    colocated = engine()
    want = run(colocated, [(f"c{i}", p, params(12, greedy), None) for i, p in enumerate(ps)])
    colocated.close()
    producer = engine("producer")
    first = run(producer, [(str(i), p, params(1, greedy), None) for i, p in enumerate(ps)])
    producer.close()
    consumer = engine("consumer")
    rest = run(
        consumer,
        [
            (str(i), p, params(12, greedy), first[str(i)]["tokens"], first[str(i)]["handle"])
            for i, p in enumerate(ps)
        ],
    )
    consumer.close()
    for i in range(len(ps)):
        assert first[str(i)]["tokens"] + rest[str(i)]["tokens"] == want[f"c{i}"]["tokens"]
    assert [rest[str(i)]["loaded"] for i in range(len(ps))] == list(PROMPT_LENS)
