"""The sampler's cost per step, device-independently: launches and bytes of its CUDA path traced
on ``meta`` tensors, and aten ops of a CPU decode step.

CUDA: batch 64, the Llama-3 vocabulary (128,256), every row with temperature, top-k 50, top-p 0.9
and the three penalties, at a step after the one that built the rows' penalty slots. Under the
graph-region tracer (``test_graph_region_meta.py``: host syncs and data-dependent shapes raise,
Triton launches are recorded, not run) ``torch.ops.pdserve.sample_tokens`` runs its CUDA impl, the
Triton launcher, as the CUDA dispatch key would. Bytes are what each launch reads and writes: the
tensors an aten op takes and returns; a Triton kernel's tensor arguments, each once — except that
pass 2 reads the logits and the counts only for a row whose kept prefix runs past its candidates,
which a row with top-k below the candidate count never does. Before the fused sampler this step
was 77 to 116 launches (eager ops over ``(B, V)``, a full-vocabulary sort, the penalties rebuilt
from Python lists) and several reads of the logits.

CPU: the ops one decode step dispatches with random sampling (and penalties) against the same
step greedy.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._pytree import tree_leaves

from common import LLM, SamplingParams
from common import sampler as sampler_module
from common.models.shapes import SHAPES
from common.sampler import Sampler, SampleRow
from kernels import sampler as sampler_kernels
from tests.engine.test_graph_region_meta import GraphRegionTracer, record_triton_launches
from tests.engine.test_step_ops import BATCH as STEP_BATCH
from tests.engine.test_step_ops import OpCounter, model_with_layers

BATCH = 64
MAX_LAUNCHES = 3
MAX_LOGITS_READS = 2.0
MAX_EXTRA_CPU_OPS = 10
# pass 2 reads these arguments only for rows that fall back (see the module docstring)
FALLBACK_ONLY = {"_sample_pick_kernel": (0, 2)}  # logits, counts


def _nbytes(tensors) -> int:
    unique = {id(t): t for t in tree_leaves(tensors) if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in unique.values())


class SamplerTracer(GraphRegionTracer):
    """The graph-region tracer, plus bytes per launch; ``pdserve.sample_tokens`` runs its CUDA
    impl (the Triton launcher) so that its kernels are recorded."""

    def __init__(self) -> None:
        super().__init__(allow_uploads=True)
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.pdserve.sample_tokens.default:
            with self:
                return sampler_kernels.sample_tokens(*args, **(kwargs or {}))
        before = self.total
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.total > before:
            self.bytes[str(func.overloadpacket)] += _nbytes((args, kwargs, out))
        return out

    def record(self, kernel, args, kwargs) -> None:
        super().record(kernel, args, kwargs)
        skipped = FALLBACK_ONLY.get(kernel, ())
        read = [a for i, a in enumerate(args) if i not in skipped]
        self.bytes[f"triton.{kernel}"] += _nbytes((read, kwargs))


def _rows(step: int) -> list[SampleRow]:
    params = SamplingParams(
        temperature=0.7, top_k=50, top_p=0.9, repetition_penalty=1.1,
        frequency_penalty=0.2, presence_penalty=0.1, max_tokens=64,
    )  # fmt: skip
    outputs = [8, 9, 10, 11][: 3 + step]
    return [
        SampleRow(params, i, 3 + step, [5, 6, 7], outputs, 2, f"request-{i}") for i in range(BATCH)
    ]


def test_sampler_cuda_path_launches_and_bytes(monkeypatch) -> None:
    def upload(values, dtype, device):  # to_device without pinning: no pinned memory here
        return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)

    monkeypatch.setattr(sampler_module, "to_device", upload)
    assert _rows(0)[0].params.top_k < sampler_kernels.CAND - 1  # pass 2 settles every row
    vocab = SHAPES["llama-3-8b"]["vocab_size"]
    logits = torch.empty(BATCH, vocab, dtype=torch.float32, device="meta")
    sampler = Sampler()
    build, tracer = SamplerTracer(), SamplerTracer()
    with torch.inference_mode():
        with record_triton_launches(build, monkeypatch), build:  # the step building the slots
            sampler.sample(logits, _rows(0))
        with record_triton_launches(tracer, monkeypatch), tracer:
            out = sampler.sample(logits, _rows(1))
    assert out.token_ids.shape == (BATCH,) and out.token_ids.device.type == "meta"
    reads = sum(tracer.bytes.values()) / (BATCH * vocab * 4)
    print(f"\nsampler, batch {BATCH}, temperature + top-k + top-p + penalties: {tracer.total} "
          f"launches {dict(tracer.launches)}, {reads:.2f} reads of the logits")  # fmt: skip
    assert tracer.launches["triton._sample_tiles_kernel"] == 1
    assert tracer.launches["triton._sample_pick_kernel"] == 1
    assert tracer.total <= MAX_LAUNCHES, dict(tracer.launches)
    assert reads <= MAX_LOGITS_READS, dict(tracer.bytes)


def _decode_step_ops(model: str, params: SamplingParams) -> Counter[str]:
    """Ops of one pure decode step of the test_step_ops batch, after a warm decode step."""
    llm = LLM(model=model, load_format="dummy")
    engine = llm.engine
    for i in range(STEP_BATCH):
        engine.add_request(str(i), [3 + i, 4, 5, 6 + i], params)
    engine.step()
    engine.step()
    with OpCounter() as counter:
        engine.step()
    return counter.ops


def test_random_sampling_costs_a_few_ops_over_greedy(tmp_path) -> None:
    model = model_with_layers(tmp_path, 2)
    common = {"max_tokens": 8, "ignore_eos": True}
    greedy = _decode_step_ops(model, SamplingParams(temperature=0.0, **common))
    random_params = SamplingParams(
        temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, seed=3, repetition_penalty=1.2,
        frequency_penalty=0.3, presence_penalty=0.2, **common,
    )  # fmt: skip
    random = _decode_step_ops(model, random_params)
    extra = sum(random.values()) - sum(greedy.values())
    print(f"\nCPU decode step: {sum(greedy.values())} ops greedy, {extra:+d} random: "
          f"{dict(random - greedy)}")  # fmt: skip
    assert random["pdserve.sample_tokens"] == 1
    assert extra <= MAX_EXTRA_CPU_OPS, dict(random - greedy)
