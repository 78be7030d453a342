"""Engine configuration: one small frozen dataclass per component, validated at construction.

Environment overrides (``PDSERVE_*``) are read once, in :func:`env_overrides`, and never deep
inside a component.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from common.spec_decode.config import SpeculativeConfig

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
_DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how. ``model`` is a built-in name or an HF directory."""

    model: str = "tiny-llama"
    dtype: DTypeName = "auto"
    load_format: Literal["auto", "dummy"] = "auto"
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    seed: int = 0  # seeds dummy weights and the engine's source of per-request seeds

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. ``num_blocks`` wins over ``kv_cache_memory_gb`` when both are set."""

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_gb: float | None = None  # None: 0.5 GiB on CPU, 90% of free memory on GPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # host memory for prefix-cache blocks evicted from the device (0: none; common/host_kv_tier)
    kv_offload_gb: float = 0.0
    # the cache's element type: "auto" (the model's dtype) or "fp8" (e4m3 with per-layer
    # scales: common/models/loader.kv_cache_torch_dtype); "fp8_e4m3" is the same
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_offload_gb < 0:
            raise ValueError(f"kv_offload_gb must be >= 0, got {self.kv_offload_gb}")
        if self.kv_offload_gb and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gb needs prefix caching (it holds evicted cached blocks)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits, per engine step."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    max_waiting: int = 4096  # admission bound; over it add_request raises QueueFullError
    max_n: int = 16  # cap of SamplingParams.n (its samples are split before the engine)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.max_waiting < 1 or self.max_n < 1:
            raise ValueError("max_waiting and max_n must be >= 1")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (vLLM's flags): ``max_loras`` adapters resident on the device at once
    (and at most that many distinct ones in a step), each of rank up to ``max_lora_rank``."""

    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")


@dataclass(frozen=True)
class RunnerConfig:
    """What the model runner needs; the engine derives it from ``EngineConfig``."""

    device: str = "auto"
    dtype: DTypeName = "auto"
    attention_backend: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    max_seq_len_to_capture: int | None = None  # None: max_model_len
    enable_expert_parallel: bool = False
    quantization: str | None = None  # "fp8": quantize the projections at load
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine instance needs; components receive only their own part."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    device: str = "auto"  # auto: cuda when available, else cpu
    # auto: triton on CUDA; on CPU the native kernel ("cpu") when it builds, else "torch"
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    kv_store: str | None = None  # redis://… or file:///…
    kv_role: Literal["producer", "consumer", "both"] | None = None
    # CPU only: torch intra-op threads of this process (None: torch's default, all cores).
    # Tiny models on few cores run faster on one thread; a node given one core wants 1.
    cpu_threads: int | None = None
    # CUDA: no decode graphs (vLLM's name); graph batch sizes (default 1, 2, 4, 8, 16, 24, …)
    # and the longest context a graph serves (None: max_model_len; longer decode steps run
    # eagerly)
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    max_seq_len_to_capture: int | None = None
    # schedule step N+1 while step N runs (None: on for CUDA, off for CPU, where the device
    # is the host and nothing would overlap); tokens are identical either way
    async_scheduling: bool | None = None
    # speculative decoding (common/spec_decode/): vLLM's dict, or None for none
    speculative_config: SpeculativeConfig | None = None
    # ranks the model is split over (common/parallel/): rank 0 in this process, the others
    # in worker processes; 1 is the single-device engine with no extra process
    tensor_parallel_size: int = 1
    # a mixture-of-experts model under tensor parallelism: each rank holds whole experts, a
    # share of them (vLLM's --enable-expert-parallel; common/models/moe.py)
    enable_expert_parallel: bool = False
    # "fp8": the decoder's projections as FP8 GEMMs, quantized at load (vLLM's --quantization);
    # an FP8 checkpoint is served as FP8 whatever this says (common/models/fp8.py)
    quantization: str | None = None
    # prepare structured outputs (xgrammar, the tokenizer's grammar data) on a worker thread
    # from start-up, so the first grammar costs what the second does (nodes); otherwise from
    # the first constrained request on. Never on the engine loop either way.
    prepare_structured_outputs: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            spec = SpeculativeConfig.from_dict(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1, got {self.cpu_threads}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.kv_role is not None and self.kv_role not in ("producer", "consumer", "both"):
            raise ValueError(f"kv_role must be producer, consumer or both, got {self.kv_role!r}")
        if self.kv_role is not None and self.kv_store is None:
            raise ValueError("kv_role needs kv_store (redis://… or file:///…)")
        if self.max_seq_len_to_capture is not None and self.max_seq_len_to_capture < 1:
            raise ValueError("max_seq_len_to_capture must be >= 1")
        if self.cuda_graph_sizes is not None:
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be >= 1, got {self.cuda_graph_sizes}")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"unsupported quantization {self.quantization!r}; use fp8")
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        """A tensor-parallel size is a positive count."""
        size = self.tensor_parallel_size
        if size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
        if size > 1 and self.cache.kv_offload_gb:
            raise ValueError("kv_offload_gb is not supported with tensor_parallel_size > 1 yet")
        if size > 1 and self.lora.enable_lora:
            raise ValueError("enable_lora is not supported with tensor_parallel_size > 1 yet")

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(
            device=self.device,
            dtype=self.model.dtype,
            attention_backend=self.attention_backend,
            load_format=self.model.load_format,
            seed=self.model.seed,
            max_num_batched_tokens=self.scheduler.max_num_batched_tokens,
            max_num_seqs=self.scheduler.max_num_seqs,
            enforce_eager=self.enforce_eager,
            cuda_graph_sizes=self.cuda_graph_sizes,
            max_seq_len_to_capture=self.max_seq_len_to_capture,
            enable_expert_parallel=self.enable_expert_parallel,
            quantization=self.quantization,
            lora=self.lora,
        )

    @staticmethod
    def from_kwargs(**kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (``LLM(model=..., block_size=..., ...)``)."""
        parts: dict[str, dict[str, Any]] = {"model": {}, "cache": {}, "scheduler": {}, "lora": {}}
        classes = {
            "model": ModelConfig,
            "cache": CacheConfig,
            "scheduler": SchedulerConfig,
            "lora": LoraConfig,
        }
        top: dict[str, Any] = {}
        top_names = {f.name for f in fields(EngineConfig)} - set(classes)
        for key, value in kwargs.items():
            owner = next((p for p, c in classes.items() if key in _field_names(c)), None)
            if owner is not None:
                parts[owner][key] = value
            elif key in top_names:
                top[key] = value
            else:
                raise ValueError(f"unknown engine argument {key!r}")
        return EngineConfig(
            model=ModelConfig(**parts["model"]),
            cache=CacheConfig(**parts["cache"]),
            scheduler=SchedulerConfig(**parts["scheduler"]),
            lora=LoraConfig(**parts["lora"]),
            **top,
        )


def _field_names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def check_bind_host(host: str) -> None:
    """A ``--host`` to bind: never empty (an empty host binds every interface without saying
    so; ``0.0.0.0`` must be asked for by name, as compose does inside containers)."""
    if not host.strip():
        raise ValueError("--host is empty: give an address to bind (default 127.0.0.1)")


def env_overrides(prefix: str = "PDSERVE_") -> dict[str, str]:
    """``PDSERVE_FOO_BAR=1`` → ``{"foo_bar": "1"}``; read once at start-up by the CLI."""
    return {k[len(prefix) :].lower(): v for k, v in os.environ.items() if k.startswith(prefix)}
