"""The decode step's launch count, device-independently: aten ops dispatched per decoder layer.

On a GPU every dispatched op is at least one kernel launch, and the step was host-bound at ~82
launches per layer. The count per layer is the difference between a 6-layer and a 2-layer model
of the same shape (everything outside the layers cancels), divided by 4. Host syncs are counted
the same way: an op that reads a device value on the host (``_local_scalar_dense`` behind
``.item()``/``int()``, or ``nonzero`` behind boolean indexing) must not appear per layer.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from common import LLM, SamplingParams
from common.models.tiny import resolve_model_path

MAX_OPS_PER_LAYER = 12
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item")
BATCH = 8


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.ops.values())


def model_with_layers(tmp_path: Path, num_layers: int, model: str = "tiny-llama") -> str:
    tiny = resolve_model_path(model)
    out = tmp_path / f"{model}-{num_layers}l"
    shutil.copytree(tiny, out, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    config.pop("layer_types", None)  # Qwen3 lists one per layer; the default is all full
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def decode_step_ops(model: str, **engine_args) -> Counter[str]:
    """Ops of one pure decode step of BATCH running requests (after every prefill is done)."""
    llm = LLM(model=model, load_format="dummy", **engine_args)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(BATCH):
        engine.add_request(str(i), [3 + i, 4, 5, 6 + i], params)
    engine.step()  # every prompt in one step
    engine.step()  # a decode step outside the count: warms every path
    with OpCounter() as counter:
        engine.step()
    return counter.ops


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layers")
    return {n: decode_step_ops(model_with_layers(tmp, n)) for n in (2, 6)}


def per_layer(counts) -> Counter[str]:
    diff = Counter(counts[6])
    diff.subtract(counts[2])
    return diff


def test_ops_per_layer(counts):
    diff = per_layer(counts)
    total = sum(diff.values())
    assert total % 4 == 0, diff
    assert total // 4 <= MAX_OPS_PER_LAYER, f"{total / 4} ops per layer: {dict(diff)}"


def test_no_host_sync_per_layer(counts):
    diff = per_layer(counts)
    assert not any(diff[op] for op in SYNC_OPS), dict(diff)
    # and none at all in the step on the CPU path: the sampled ids are read with tolist()
    assert not any(counts[6][op] for op in SYNC_OPS), dict(counts[6])


def test_ops_per_layer_overlapped_loop(tmp_path):
    """The overlapped loop adds nothing per layer either."""
    ops = {
        n: decode_step_ops(model_with_layers(tmp_path, n), async_scheduling=True) for n in (2, 6)
    }
    assert sum(per_layer(ops).values()) // 4 <= MAX_OPS_PER_LAYER


def test_qwen3_ops_per_layer(tmp_path):
    """Qwen3's q/k norms add five kernels per layer (two head-row copies, two norms, one cat),
    and no host sync."""
    ops = {n: decode_step_ops(model_with_layers(tmp_path, n, "tiny-qwen3")) for n in (2, 6)}
    diff = per_layer(ops)
    assert sum(diff.values()) // 4 <= MAX_OPS_PER_LAYER + 6, dict(diff)
    assert diff["pdserve.rms_norm"] == 2 * 4  # q_norm and k_norm in each of the 4 extra layers
    assert not any(diff[op] for op in SYNC_OPS), dict(diff)


def test_tp1_is_the_single_device_step(tmp_path):
    """``tensor_parallel_size=1`` is the single-device engine: no worker process, no collective
    in the step, and the op and sync counts of the default engine, op for op."""
    import multiprocessing

    model = model_with_layers(tmp_path, 2)
    default = decode_step_ops(model)
    explicit = decode_step_ops(model, tensor_parallel_size=1)
    assert explicit == default
    assert not any(op.startswith("c10d") for op in explicit), dict(explicit)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("model", ["tiny-mixtral", "tiny-qwen3-moe"])
def test_moe_sparse_mlp_ops_per_decode_step(tmp_path, model):
    """A MoE layer's sparse MLP (router to weighted sum: BATCH tokens × top 2 assignments) is
    one op in a decode step, ``kernels/moe_cpu.py``'s native call, whatever experts the tokens
    hit, and nothing reads the device on the host (it was 20 + 5 per expert hit, then 12 with
    the gathered path in PyTorch). The layer's other ops are the dense layer's outside its MLP
    (7, and 15 with Qwen3's q/k norms): a MoE layer is 8 ops (≤ MAX_OPS_PER_LAYER, as a dense
    Llama layer), a Qwen3-MoE one 16 (a dense Qwen3 layer's 18 with its MLP's three)."""
    from common.models.moe import SparseMoe

    def run(path: str) -> tuple[Counter[str], list[int]]:
        llm = LLM(model=path, load_format="dummy")
        engine, inside = llm.engine, []
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for i in range(BATCH):
            engine.add_request(str(i), [3 + i, 4, 5, 6 + i], params)
        engine.step()
        engine.step()
        with OpCounter() as counter:
            for moe in engine.runner.model.modules():
                if isinstance(moe, SparseMoe):
                    moe.register_forward_pre_hook(lambda *_: inside.append(-counter.total()))
                    moe.register_forward_hook(lambda *_: inside.append(counter.total()))
            engine.step()
        sums = [a + b for a, b in zip(inside[::2], inside[1::2], strict=True)]
        return counter.ops, sums

    ops, mlp = {}, {}
    for n in (2, 6):
        ops[n], mlp[n] = run(model_with_layers(tmp_path, n, model))
    diff = per_layer(ops)
    assert len(mlp[6]) == 6 and len(set(mlp[6])) == 1, mlp  # every sparse layer alike
    assert mlp[6][0] == 1, f"{mlp[6][0]} ops in the sparse MLP"
    dense_part = 7 if model == "tiny-mixtral" else 15
    assert sum(diff.values()) == 4 * (dense_part + 1), dict(diff)
    assert dense_part + 1 <= (MAX_OPS_PER_LAYER if model == "tiny-mixtral" else 18)
    assert not any(diff[op] for op in (*SYNC_OPS, "aten.bincount")), dict(diff)
