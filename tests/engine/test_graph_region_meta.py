"""The CUDA-graph region of a decode step, traced on ``meta`` tensors at real model shapes.

What ``common/cuda_graphs.py`` captures — the decode forward of a padded batch, embedding to final
norm, reading the runner's fixed input buffers and the paged cache — is run once with a
Llama-3-8B-shaped (and a Qwen3-shaped) model whose parameters, inputs and cache are all ``meta``:
nothing is allocated, nothing is computed, and the attention backend is the CUDA one (the Triton
kernels), whose launches are recorded instead of run. Under :class:`GraphRegionTracer` every aten
op is checked and counted:

- a host sync (``.item()``, ``.tolist()``, ``nonzero``...) raises: a graph cannot capture it, and
  outside a graph it stalls the step;
- a CPU tensor argument raises: inside a graph it would be a stale host read or an illegal
  address;
- an op whose output shape depends on data (``nonzero``, ``masked_select``, ``unique``) raises;
- an op that would launch a kernel (not a view, not an allocation) counts, as does each Triton
  launch and each fused ``pdserve`` op (one Triton kernel on CUDA). Composite ops (``linear``,
  ``reshape``) are decomposed first, so a reshape that must copy counts and one that views does
  not.

The count per decoder layer is the difference between the full-depth model and a 2-layer one of
the same shape (everything outside the layers cancels). The sampler, which runs outside the
graph, is traced the same way at batch 64 with temperature and top-p: its launches are reported,
and host syncs are refused (its uploads of per-row parameters are allowed: pinned, non-blocking).
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common import sampler as sampler_module
from common.attention import TritonAttentionBackend
from common.cuda_graphs import DecodeGraphs
from common.models.llama import LlamaArgs, LlamaForCausalLM
from common.models.shapes import SHAPES
from common.sampler import Sampler, SampleRow
from common.sampling_params import SamplingParams
from common.step_inputs import BatchLimits, InputBuffers

MAX_LAUNCHES_PER_LAYER = 12
QK_NORM_LAUNCHES = 5  # Qwen3: two head-row copies, two norms, one concatenation (llama.py)
BATCH = 64
BLOCK_SIZE = 16
MAX_SEQ_LEN_TO_CAPTURE = 8192  # the engine's default graph width
NUM_BLOCKS = 4096

SYNC_OPS = {
    "aten._local_scalar_dense",  # .item(), int(t), float(t), .tolist()
    "aten.item",
    "aten.nonzero",
    "aten.nonzero_static",
    "aten.is_nonzero",
    "aten.equal",
}
# Ops that run no kernel: allocations and aliasing (views are told by their schema).
NO_LAUNCH_OPS = {
    "aten.empty",
    "aten.empty_strided",
    "aten.empty_like",
    "aten.new_empty",
    "aten.new_empty_strided",
    "aten.detach",
    "aten.alias",
    "aten._unsafe_view",  # the view after a reshape's copy (the copy itself counts)
}
DATA_DEPENDENT_TAGS = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)


class GraphRegionViolation(AssertionError):
    """Something a CUDA graph cannot hold, or that syncs the host, was dispatched."""


class GraphRegionTracer(TorchDispatchMode):
    """Checks and counts every dispatched op (see the module docstring).

    ``allow_uploads``: a non-blocking copy of a host tensor to the device (``_to_copy``), as the
    sampler's pinned uploads of per-row parameters, is counted under ``uploads`` instead of
    raising (and the host tensor it copies may be made: ``lift_fresh``); every other CPU tensor
    argument still raises.
    ``launches``: op name → count (Triton launches as ``triton.<kernel>``, via :meth:`record`).
    """

    def __init__(self, allow_uploads: bool = False) -> None:
        super().__init__()
        self.allow_uploads = allow_uploads
        self.launches: Counter[str] = Counter()
        self.uploads = 0
        self.ops: Counter[str] = Counter()  # every op dispatched, launching or not

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _composite(func):  # checked and counted as the ops it is made of
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = str(func.overloadpacket)
        self.ops[name] += 1
        if name in SYNC_OPS:
            raise GraphRegionViolation(f"host sync: {name}")
        if any(tag in func.tags for tag in DATA_DEPENDENT_TAGS):
            raise GraphRegionViolation(f"data-dependent output shape: {name}")
        host = [t for t in tree_leaves((args, kwargs)) if _on_host(t)]
        if host and not (self.allow_uploads and _host_side_or_upload(name, kwargs)):
            shapes = [tuple(t.shape) for t in host]
            raise GraphRegionViolation(f"CPU tensor argument of {name}: shapes {shapes}")
        if host and name == "aten.lift_fresh":
            return func(*args, **kwargs)  # a host tensor made from Python values: no launch
        self.uploads += bool(host)
        if _launches(func, name):
            self.launches[name] += 1
        return func(*args, **kwargs)

    def record(self, kernel: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One Triton launch instead of running it: its tensors must be on the device."""
        host = [t for t in tree_leaves((args, kwargs)) if _on_host(t)]
        if host:
            raise GraphRegionViolation(f"CPU tensor argument of Triton kernel {kernel}")
        self.launches[f"triton.{kernel}"] += 1

    @property
    def total(self) -> int:
        return sum(self.launches.values())


def _on_host(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cpu"


def _host_side_or_upload(name: str, kwargs: dict[str, Any]) -> bool:
    if name == "aten.lift_fresh":
        return True
    device = kwargs.get("device")
    to_device = device is not None and torch.device(device).type != "cpu"
    return name == "aten._to_copy" and to_device and bool(kwargs.get("non_blocking"))


def _composite(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _launches(func, name: str) -> bool:
    return not func.is_view and name not in NO_LAUNCH_OPS


class _RecordedKernel:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` is recorded, not run."""

    def __init__(self, name: str, tracer: GraphRegionTracer) -> None:
        self.name, self.tracer = name, tracer

    def __getitem__(self, grid: object):
        return lambda *args, **kwargs: self.tracer.record(self.name, args, kwargs)


@contextmanager
def record_triton_launches(
    tracer: GraphRegionTracer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Every kernel of the launcher modules records into ``tracer``; the launchers' device check
    (CUDA tensors, or the interpreter) is lifted, as :func:`kernels.cross_compile.compile_only`
    does, so they take ``meta`` tensors."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction

    import kernels  # noqa: F401 - imports every launcher module

    kinds = (triton.runtime.JITFunction, InterpretedFunction)
    with monkeypatch.context() as patch:
        for module in launcher_modules():
            patch.setattr(module, "check_runnable", lambda kernel, device: None)
            for attr, value in vars(module).copy().items():
                if isinstance(value, kinds):
                    patch.setattr(module, attr, _RecordedKernel(attr, tracer))
        yield


def launcher_modules() -> list[object]:
    """The imported ``kernels`` modules that launch Triton kernels (each checks its device)."""
    return [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("kernels.") and name != "kernels._common"
        and hasattr(module, "check_runnable")
    ]  # fmt: skip


# -- the model, inputs and cache on meta --------------------------------------------------------
def meta_model(shape: str, num_layers: int) -> LlamaForCausalLM:
    """The model of a named shape (``common/models/shapes.py``) at ``num_layers``, on ``meta``
    in bf16, with the CUDA attention backend."""
    config = dict(SHAPES[shape], num_hidden_layers=num_layers)
    args = LlamaArgs.from_hf(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(args, TritonAttentionBackend(), args.max_position_embeddings)
    return model.to(torch.bfloat16).eval()


def meta_buffers(max_model_len: int) -> InputBuffers:
    """The runner's input buffers with their device halves on ``meta`` (the host halves are
    what ``prepare`` writes; the graph region reads only the device halves)."""
    limits = BatchLimits(
        max_tokens=2048, max_seqs=256, max_blocks_per_seq=-(-max_model_len // BLOCK_SIZE)
    )
    buffers = InputBuffers(limits, BLOCK_SIZE, torch.device("meta"))
    buffers.int64 = torch.empty(buffers.off.int64_size, dtype=torch.int64, device="meta")
    buffers.int32 = torch.empty(buffers.off.int32_size, dtype=torch.int32, device="meta")
    return buffers


def meta_kv_layers(model: LlamaForCausalLM) -> list[torch.Tensor]:
    a = model.args
    shape = (a.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, model.num_local_kv_heads, a.head_dim)
    return list(torch.empty(shape, dtype=torch.bfloat16, device="meta").unbind(0))


def trace_graph_region(shape: str, num_layers: int, monkeypatch) -> GraphRegionTracer:
    """One decode forward of a ``BATCH``-row graph, as ``DecodeGraphs`` captures it, traced."""
    model = meta_model(shape, num_layers)
    max_model_len = model.args.max_position_embeddings
    inputs = meta_buffers(max_model_len)
    max_seq_len = min(MAX_SEQ_LEN_TO_CAPTURE, max_model_len)
    graphs = DecodeGraphs(model, inputs, BLOCK_SIZE, [BATCH], max_seq_len, capture=False)
    graphs.capture_all(meta_kv_layers(model))
    views = inputs.views(BATCH, BATCH, graphs.row_stride)  # what the graph reads
    tracer = GraphRegionTracer()
    with record_triton_launches(tracer, monkeypatch), torch.inference_mode(), tracer:
        hidden = graphs.replay(BATCH, views)
    assert hidden.device.type == "meta" and hidden.shape == (BATCH, model.args.hidden_size)
    return tracer


def per_layer(shape: str, monkeypatch) -> tuple[Counter[str], int]:
    """(launches per op over the extra layers, number of extra layers): full depth minus 2."""
    depth = SHAPES[shape]["num_hidden_layers"]
    deep, shallow = (trace_graph_region(shape, n, monkeypatch) for n in (depth, 2))
    diff = Counter(deep.launches)
    diff.subtract(shallow.launches)
    return +diff, depth - 2


# -- the tests ------------------------------------------------------------------------------------
def test_the_tracer_refuses_what_a_graph_cannot_hold():
    """The checks this file relies on fire: a test whose checker never fires proves nothing."""
    x = torch.empty(4, device="meta")
    for bad in (
        lambda: x.nonzero(),
        lambda: x[x > 0],
        lambda: x.sum().item(),
        lambda: x + torch.ones(4),
    ):
        with pytest.raises(GraphRegionViolation), GraphRegionTracer():
            bad()


def test_the_recorder_sees_triton_launches(monkeypatch):
    rms_norm = importlib.import_module("kernels.rms_norm")
    tracer = GraphRegionTracer()
    x = torch.empty(8, 4096, dtype=torch.bfloat16, device="meta")
    weight = torch.empty(4096, dtype=torch.bfloat16, device="meta")
    with record_triton_launches(tracer, monkeypatch), tracer:
        rms_norm.rms_norm(x, weight, 1e-5)
    assert tracer.launches["triton._rms_norm_kernel"] == 1, tracer.launches


@pytest.mark.parametrize(
    ("shape", "limit"),
    [
        ("llama-3-8b", MAX_LAUNCHES_PER_LAYER),
        ("qwen3-0.6b", MAX_LAUNCHES_PER_LAYER + QK_NORM_LAUNCHES),
    ],
)
def test_graph_region_launches_per_layer(shape, limit, monkeypatch):
    diff, extra = per_layer(shape, monkeypatch)
    total = sum(diff.values())
    assert total % extra == 0, f"layers differ from one another: {dict(diff)}"
    per = total // extra
    print(f"\n{shape}: {per} launches per layer: { {k: v // extra for k, v in diff.items()} }")
    assert per <= limit, f"{per} launches per layer (limit {limit}): {dict(diff)}"
    # the attention of a graph is the Triton decode kernel, not a torch fallback
    assert diff["triton._paged_decode_attention_kernel"] == extra, dict(diff)


def test_graph_region_whole_step(monkeypatch):
    """The whole forward of the real depth traces clean (no violation raised) and every decoder
    layer launches the same kernels."""
    tracer = trace_graph_region("llama-3-8b", 32, monkeypatch)
    assert tracer.launches["pdserve.rotary_embedding_and_cache"] == 32
    assert tracer.launches["triton._paged_decode_attention_kernel"] == 32
    print(f"\nllama-3-8b graph region, batch {BATCH}: {tracer.total} launches")


def _sample_rows(n: int) -> list[SampleRow]:
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=64)
    return [SampleRow(params, seed=i, position=3, prompt_token_ids=[5, 6, 7],
                      output_token_ids=[8, 9, 10], eos_token_id=2) for i in range(n)]  # fmt: skip


def test_sampler_traced_on_meta(monkeypatch):
    """Batch 64, temperature + top-p, the Llama-3 vocabulary: no host sync, no data-dependent
    shape; its launch count is reported (a later issue fuses the sampler)."""

    def upload(values, dtype, device):  # to_device without pinning: no pinned memory here
        return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

    monkeypatch.setattr(sampler_module, "to_device", upload)
    vocab = SHAPES["llama-3-8b"]["vocab_size"]
    logits = torch.empty(BATCH, vocab, dtype=torch.float32, device="meta")
    tracer = GraphRegionTracer(allow_uploads=True)
    with torch.inference_mode(), tracer:
        out = Sampler().sample(logits, _sample_rows(BATCH))
    assert out.token_ids.shape == (BATCH,) and out.token_ids.device.type == "meta"
    print(f"\nsampler, batch {BATCH}, temperature + top-p: {tracer.total} launches "
          f"({tracer.uploads} uploads): {dict(tracer.launches)}")  # fmt: skip
    assert tracer.uploads > 0 and tracer.total > tracer.uploads


def test_block_table_rows_on_the_device_take_two_launches_and_no_sync():
    """A step's block tables on CUDA (``common/step_inputs.py``'s ``_DeviceRows``, traced on
    ``meta``): the staged changes applied to the device rows and the step's table gathered from
    them, at 256 sequences x 128k ``max_model_len``: two launches, no host sync, no host tensor
    (the tables themselves never cross from the host)."""
    from common.step_inputs import _DeviceRows, _offsets

    limits = BatchLimits(max_tokens=8192, max_seqs=256, max_blocks_per_seq=131072 // BLOCK_SIZE)
    o = _offsets(limits)
    int32 = torch.empty(o.int32_size, dtype=torch.int32, device="meta")
    rows = _DeviceRows(2 * limits.max_seqs + 1, limits.max_blocks_per_seq, int32, o)
    tracer = GraphRegionTracer()
    with torch.inference_mode(), tracer:
        rows.apply(16)
        rows.gather(256, limits.max_blocks_per_seq)
    assert tracer.launches == {"aten.index_put_": 1, "aten.index_select": 1}, tracer.launches
