"""GPU memory and device handling, proven on the CPU: what loading would allocate on the device
(the model built on ``meta``, its storage audited), the KV budget and a draft model's share of it
from faked ``torch.cuda`` queries with an H100's figures, and the device an engine binds."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import common.memory_profile as memory_profile
import common.model_runner as model_runner
from common import LLM, SamplingParams, penalty_counts
from common.config import CacheConfig, EngineConfig, RunnerConfig
from common.kv_interface import KVCacheSpec
from common.memory_profile import KVReserve, StepLimits, cuda_kv_budget
from common.model_runner import ModelRunner, bind_device, resolve_device
from common.models.llama import LlamaArgs, LlamaForCausalLM
from common.models.loader import _fill_dummy, build_on_meta, materialize, read_hf_config
from common.models.shapes import write_dummy_shape
from common.models.tiny import resolve_model_path
from common.spec_decode.config import SpeculativeConfig
from common.spec_decode.draft_model import draft_footprint

GiB = 2**30
H100_TOTAL = 85_031_714_816  # torch.cuda.mem_get_info()[1] on an H100 80GB HBM3


class DeviceAllocations(TorchDispatchMode):
    """Every new storage an op creates on ``device_type``, with its bytes. Outputs are kept
    alive so that no storage is freed and its address reused: the sum of ``allocated`` is then
    an upper bound of the peak, however the allocations interleave with frees."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.allocated: list[tuple[str, torch.dtype, int]] = []
        self._seen: set[int] = set()
        self._keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = tree_flatten((args, kwargs))[0]
        inputs = {t.untyped_storage()._cdata for t in tensors if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            if storage._cdata not in inputs and storage._cdata not in self._seen:
                self._seen.add(storage._cdata)
                self._keep.append(t)
                self.allocated.append((str(func.overloadpacket), t.dtype, storage.nbytes()))
        return out

    @property
    def total(self) -> int:
        return sum(n for _, _, n in self.allocated)


def _layer_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.layers[0].parameters()) * elem


@pytest.mark.parametrize("shape", ["llama-3-8b", "qwen3-0.6b"])
def test_loading_allocates_the_model_once_in_its_dtype(shape):
    """Llama-3-8B in bf16 is 15 GiB; built as before (fp32 on the device, then cast) loading
    held 30 GiB first. Construction allocates nothing (meta); materialising allocates each
    parameter once in bf16, plus the rotary table: at most one layer beyond the bf16 size."""
    args = LlamaArgs.from_hf(read_hf_config(write_dummy_shape(shape)))
    model = build_on_meta(args, None, 8192, None)  # type: ignore[arg-type]
    assert all(p.device.type == "meta" for p in model.parameters())
    with DeviceAllocations("meta") as device:  # meta stands in for the GPU from here on
        materialize(model, torch.bfloat16, torch.device("meta"))
    params = {id(p): p for p in model.parameters()}.values()  # a tied tensor once
    bf16_size = sum(p.numel() * 2 for p in params)
    assert all(p.dtype == torch.bfloat16 and p.device.type == "meta" for p in params)
    assert bf16_size <= device.total <= bf16_size + _layer_bytes(model, torch.bfloat16)
    wide = [(op, n) for op, dtype, n in device.allocated if dtype == torch.float32]
    assert sum(n for _, n in wide) < _layer_bytes(model, torch.bfloat16), wide
    if args.tie_word_embeddings:
        assert model.lm_head.weight is model.embed_tokens.weight


def test_filling_weights_allocates_nothing_more_on_the_device(tmp_path):
    """The dummy fill and a checkpoint in fp32 both cast on the host: the device only receives
    values into the parameters it already has."""
    args = LlamaArgs.from_hf(read_hf_config(resolve_model_path("tiny-llama")))
    model = build_on_meta(args, None, 256, None)  # type: ignore[arg-type]
    materialize(model, torch.bfloat16, torch.device("meta"))
    with DeviceAllocations("meta") as device:
        _fill_dummy(model, seed=0)
    assert device.allocated == []


def test_loaded_model_equals_the_one_built_in_place():
    """Built on meta and materialised, the model computes what it computed before: the rotary
    table of a model built on the device (fp32, then cast) and the same dummy weights."""
    llm = LLM(
        model="tiny-llama", dtype="bfloat16", load_format="dummy", num_blocks=64, max_model_len=256
    )
    model = llm.engine.runner.model
    expected = LlamaForCausalLM(model.args, llm.engine.runner.backend, llm.engine.max_model_len)
    expected.to(torch.bfloat16)  # the old way: built in fp32 on the device, then cast
    assert torch.equal(model.rotary.cos_sin_cache, expected.rotary.cos_sin_cache)
    assert model.rotary.cos_sin_cache.dtype == torch.bfloat16
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


# -- the KV budget, from faked torch.cuda queries -------------------------------------------------


class _FakeCuda:
    """An H100 right after loading Llama-3-8B: 15 GiB of weights live, and (as the fp32 build
    left it) 15 GiB more of freed blocks still in the allocator's cache until ``empty_cache``."""

    def __init__(self, monkeypatch, weights: int = 15 * GiB, cached: int = 15 * GiB) -> None:
        self.weights, self.cached = weights, cached
        self.emptied = False
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: self.mem_get_info())

    @property
    def reserved(self) -> int:
        return self.weights + (0 if self.emptied else self.cached)

    def empty_cache(self) -> None:
        self.emptied = True

    def mem_get_info(self) -> tuple[int, int]:
        context = 500 * 2**20
        return H100_TOTAL - self.reserved - context, H100_TOTAL


class _Runner:
    """What ``_num_blocks`` reads of a runner (besides its KV spec)."""

    device = torch.device("cuda", 0)
    config = RunnerConfig(max_num_batched_tokens=8192, max_num_seqs=256)
    max_model_len = 8192
    graphs = None


def _budget(spec: KVCacheSpec) -> int:
    """``cuda_kv_budget`` for ``_Runner``'s limits (its steps' peaks are patched in)."""
    limits = StepLimits(8192, 256, 8192, graph_batch=None)
    return cuda_kv_budget(_Runner.device, spec, limits, lambda *a: None, 0.9)


STEP_PEAK = 3 * GiB


def test_kv_budget_counts_only_what_is_held(monkeypatch):
    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(memory_profile, "_profile", lambda *a, **k: STEP_PEAK)
    budget = _budget(LLAMA_3_8B_KV)
    assert fake.emptied
    expected = int(H100_TOTAL * 0.9 - 15 * GiB - STEP_PEAK - memory_profile._MARGIN)
    assert budget == expected
    assert budget > 52 * GiB  # before: ~15 GiB less (the cached fp32 blocks counted as held)


def _runner_for(spec: KVCacheSpec, cache: CacheConfig, reserve: KVReserve | None) -> ModelRunner:
    """A runner with only what ``_num_blocks`` reads (no model, no device)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.spec, runner.reserve, runner.tp = spec, reserve, None
    runner.device = torch.device("cuda", 0)
    runner.config = _Runner.config
    runner.max_model_len = _Runner.max_model_len
    runner.graphs = None
    runner.vocab_size = LLAMA_3_VOCAB
    return runner


LLAMA_3_8B_KV = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)  # 2 MiB per 16-token block
LLAMA_3_VOCAB = 128_256


def test_the_penalty_counts_are_set_aside_before_the_kv_cache(monkeypatch):
    """A full engine's first penalised requests make the sampler's counts (``max_num_seqs``
    slots of the vocabulary, int16): no profiled step shows them, so the budget sets them
    aside. Before, they came out of the memory the KV cache had already taken."""
    _FakeCuda(monkeypatch)
    monkeypatch.setattr(memory_profile, "_profile", lambda *a, **k: STEP_PEAK)
    budget = _budget(LLAMA_3_8B_KV)  # StepLimits without the counts
    runner = _runner_for(LLAMA_3_8B_KV, CacheConfig(), None)
    blocks = runner._num_blocks(CacheConfig())
    kept = penalty_counts.reserved_bytes(256, LLAMA_3_VOCAB)
    assert kept == (256 + 128) * LLAMA_3_VOCAB * 2  # ~94 MiB: the doubling to 256 slots
    assert blocks == (budget - kept) // LLAMA_3_8B_KV.bytes_per_block


def test_draft_model_is_reserved_before_the_target_sizes_its_cache(monkeypatch):
    """Llama-3-8B with a Llama-3.2-1B draft on an H100: the draft's weights come out of the
    budget and every block is counted with the draft's KV; both caches together fit."""
    _FakeCuda(monkeypatch)
    monkeypatch.setattr(memory_profile, "_profile", lambda *a, **k: STEP_PEAK)
    target = EngineConfig(
        model=_model_config(),
        speculative_config=SpeculativeConfig(
            method="draft_model", model=str(write_dummy_shape("llama-3.2-1b"))
        ),
    )
    reserve = draft_footprint(target.speculative_config, target)  # type: ignore[arg-type]
    assert 2.2 * GiB < reserve.weight_bytes < 2.4 * GiB  # 1.24 B parameters in bf16
    assert reserve.bytes_per_block == 16 * 8 * 64 * 2 * 2 * 16  # 16 layers of 8 x 64 heads
    kept = penalty_counts.reserved_bytes(256, LLAMA_3_VOCAB)  # the sampler's, set aside too
    budget = _budget(LLAMA_3_8B_KV) - kept
    alone = _runner_for(LLAMA_3_8B_KV, CacheConfig(), None)._num_blocks(CacheConfig())
    shared = _runner_for(LLAMA_3_8B_KV, CacheConfig(), reserve)._num_blocks(CacheConfig())
    assert alone == budget // LLAMA_3_8B_KV.bytes_per_block
    held = reserve.weight_bytes + shared * (LLAMA_3_8B_KV.bytes_per_block + reserve.bytes_per_block)
    assert held <= budget < held + LLAMA_3_8B_KV.bytes_per_block + reserve.bytes_per_block
    assert 0 < shared < alone


def test_draft_shares_an_explicit_kv_budget_instead_of_taking_it_again(monkeypatch):
    """``kv_cache_memory_gb`` is the KV of both models: not the draft's weights, not twice."""
    reserve = KVReserve(weight_bytes=2 * GiB, bytes_per_block=LLAMA_3_8B_KV.bytes_per_block // 4)
    cache = CacheConfig(kv_cache_memory_gb=10)
    blocks = _runner_for(LLAMA_3_8B_KV, cache, reserve)._num_blocks(cache)
    assert blocks == 10 * GiB // (LLAMA_3_8B_KV.bytes_per_block + reserve.bytes_per_block)


def _model_config():
    from common.config import ModelConfig

    return ModelConfig(str(write_dummy_shape("llama-3-8b")), "bfloat16", load_format="dummy")


def test_draft_engine_gets_the_targets_block_count():
    """End to end on the CPU: the draft's cache has exactly the target's block count, and both
    caches fit in the KV budget asked for."""
    gb = 0.01
    llm = LLM(
        model="tiny-llama",
        kv_cache_memory_gb=gb,
        max_model_len=256,
        speculative_config={
            "method": "draft_model",
            "model": "tiny-llama",
            "num_speculative_tokens": 2,
        },
    )
    target = llm.engine.runner
    draft = llm.engine.proposer.engine.runner  # type: ignore[union-attr]
    assert draft.num_blocks == target.num_blocks
    both = target.num_blocks * (target.spec.bytes_per_block + draft.spec.bytes_per_block)
    assert both <= gb * GiB < both + target.spec.bytes_per_block + draft.spec.bytes_per_block
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert len(llm.generate([[3, 4, 5, 6]], params, use_tqdm=False)[0].outputs[0].token_ids) == 8


# -- the device an engine binds -------------------------------------------------------------------


class _DeviceCalls:
    def __init__(self, monkeypatch, current: int = 0) -> None:
        self.current, self.bound = current, []
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)

    def set_device(self, device) -> None:
        self.bound.append(torch.device(device))
        self.current = torch.device(device).index


def test_cuda_device_is_resolved_with_its_index_and_bound(monkeypatch):
    calls = _DeviceCalls(monkeypatch)
    assert resolve_device("cuda") == torch.device("cuda", 0)
    device = resolve_device("cuda:1")
    bind_device(device)
    assert calls.bound == [torch.device("cuda", 1)]
    bind_device(device)  # already current: nothing to do
    bind_device(torch.device("cpu"))
    assert calls.bound == [torch.device("cuda", 1)]


class _Built(Exception):
    pass


def test_runner_binds_its_device_before_it_builds_anything(monkeypatch, tmp_path):
    """``device="cuda:1"``: the runner binds cuda:1 before the model, its kernels or events
    exist (nothing past that point can run without a GPU: building the model stops the test)."""
    calls = _DeviceCalls(monkeypatch)

    def build_model(*args, **kwargs):
        assert calls.current == 1, "the model was built before cuda:1 was bound"
        raise _Built

    monkeypatch.setattr(model_runner, "build_model", build_model)
    model_dir = resolve_model_path("tiny-llama")
    with pytest.raises(_Built):
        ModelRunner(
            model_dir,
            read_hf_config(model_dir),
            config=RunnerConfig(device="cuda:1", attention_backend="torch"),
            cache_config=CacheConfig(),
            max_model_len=256,
        )
    assert calls.bound == [torch.device("cuda", 1)]
