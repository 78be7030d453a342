"""The throughput benchmark runs end to end on CPU (GPU shapes scaled down to two layers)."""

import argparse

import pytest

from benchmarks.throughput import run


def args(**kw) -> argparse.Namespace:
    base = dict(
        model="tiny-llama",
        shape=None,
        shape_layers=None,
        num_requests=6,
        input_len=(4, 40),
        output_len=(2, 12),
        seed=0,
        temperature=0.6,
        dtype="auto",
        device="cpu",
        hf_batch_size=4,
        skip_hf=False,
        max_num_batched_tokens=256,
        cpu_threads=None,
        attention_backend="auto",
        roofline_batch=4,
        roofline_context=32,
        gpu_workload=False,
        json=None,
        enforce_eager=False,
        quantization=None,
    )
    return argparse.Namespace(**(base | kw))


def test_cpu_workload_against_hf():
    report = run(args())
    assert report["pdserve"]["output_tokens"] == report["hf"]["output_tokens"] > 0
    assert report["ratio"] > 0
    assert report["decode_roofline"]["step_ms"] > 0


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_gpu_shape_smoke(quantization):
    report = run(
        args(
            shape="qwen2-0.5b",
            shape_layers=2,
            dtype="float32",
            num_requests=2,
            skip_hf=True,
            roofline_batch=2,
            quantization=quantization,
        )
    )
    assert report["pdserve"]["output_tokens"] > 0
    assert report["workload"]["quantization"] == quantization


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ("llama-3.2-1b", "float32"),
        # the MoE shape (Qwen3-30B-A3B's): one layer is 1.2 B parameters in bf16
        pytest.param("qwen3-30b-a3b", "auto", marks=pytest.mark.slow),
    ],
)
def test_named_shape_runs_against_hf(shape: str, dtype: str):
    """`--shape` end to end, HF included: the written config must load in transformers
    (it once lacked `model_type`, which transformers 5 requires)."""
    report = run(
        args(
            shape=shape,
            shape_layers=1,
            dtype=dtype,
            num_requests=2,
            input_len=(4, 8),
            output_len=(2, 3),
            hf_batch_size=2,
            roofline_batch=0,
        )
    )
    assert report["pdserve"]["output_tokens"] == report["hf"]["output_tokens"] > 0


def test_every_shape_loads_in_transformers():
    from transformers import AutoConfig

    from common.models.shapes import SHAPES, write_dummy_shape

    for name, shape in SHAPES.items():
        config = AutoConfig.from_pretrained(write_dummy_shape(name, num_layers=1))
        assert config.architectures == shape["architectures"]
        assert config.hidden_size == shape["hidden_size"]
