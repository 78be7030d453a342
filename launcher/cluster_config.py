"""``pdserve up`` flags and the :class:`ClusterConfig` they make.

`up` is configured by its flags only: it scrubs ``PDSERVE_*`` variables from its children and
passes each setting explicitly (``PDSERVE_*`` variables configure the individual services, as
compose.yaml does).

Device: ``--device auto`` means CUDA when an NVIDIA device node exists, else CPU. CPU nodes get
``--cpu-threads 1`` (a node on a shared small machine runs best on one torch thread). GPU nodes
are spread over ``--gpus`` (default: every GPU found): a node of a pool at ``--prefill-tp`` /
``--decode-tp`` N gets N distinct GPUs, the least used (``launcher/gpus.py``); when nodes must
share GPUs, ``--kv-cache-gb`` caps each node's KV cache (the engine's default takes 90% of free
memory, which only one node can do). With ``--autoscale`` the GPUs are the autoscaler's budget.

Engine and serving flags carry vLLM's names and meanings (``--max-model-len``, ``--block-size``,
``--dtype``, ``--max-num-seqs``, ``--max-num-batched-tokens``, ``--gpu-memory-utilization``,
``--enforce-eager``; ``--served-model-name``, ``--api-key``): the engine ones go to every node,
the serving ones to the router. ``--node-args`` comes after them, so it can still override any.

Ports: ``--port``/``--grpc-port`` default to 8000/50051, and to free ports with ``--demo``.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from bench.slo import parse_slo
from common.config import check_bind_host
from common.lora.adapter import parse_lora_modules
from launcher.gpus import check_tp_fits
from router.autoscale.policy import PoolLimits

if TYPE_CHECKING:
    from router.node_clients import NodeTLS

KV_STORES = ("shm", "file", "redis")
KV_URL_SCHEMES = (
    "redis://",
    "rediss://",
    "redis+cluster://",
    "rediss+cluster://",
    "file://",
    "shm://",
)


def cuda_present() -> bool:
    """An NVIDIA device node exists (cheap: no torch import, no CUDA context)."""
    return count_gpus() > 0


def count_gpus() -> int:
    """NVIDIA device nodes (``/dev/nvidiaN``): the GPUs this machine or container shows."""
    return sum(1 for path in Path("/dev").glob("nvidia[0-9]*") if path.name[6:].isdigit())


# --dtype: vLLM's spellings -> the engine's
_DTYPES = {
    "auto": "auto",
    "float32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class EngineFlags:
    """vLLM's engine flags, as given to `up` (None: the engine's default); every node gets them."""

    max_model_len: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = False
    enable_expert_parallel: bool = False  # a MoE model at TP > 1: experts sharded whole
    quantization: str | None = None  # "fp8": the projections quantized at load
    kv_cache_dtype: str | None = None  # "fp8": an e4m3 KV cache (and store entries)
    speculative_config: str | None = None  # vLLM's JSON; the decode nodes use it
    seed: int | None = None
    enable_prefix_caching: bool | None = None  # --[no-]enable-prefix-caching
    async_scheduling: bool | None = None  # --[no-]async-scheduling
    enable_lora: bool = False
    lora_modules: str | None = None  # "name=path name=path" (the nodes read the directories)
    max_loras: int | None = None
    max_lora_rank: int | None = None

    def __post_init__(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        bs = self.block_size
        if bs is not None and (bs < 1 or bs & (bs - 1)):
            raise ValueError(f"--block-size must be a power of two, got {bs}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        util = self.gpu_memory_utilization
        if util is not None and not (0.0 < util <= 1.0):  # NaN fails this too
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineFlags:
        names = [f.name for f in fields(cls)]
        values = {name: getattr(args, name) for name in names}
        if values["lora_modules"]:  # vLLM's `--lora-modules a=/p b=/q`, paths made absolute
            specs = parse_lora_modules(values["lora_modules"])
            values["lora_modules"] = " ".join(f"{n}={Path(p).resolve()}" for n, p in specs.items())
        return cls(**values)

    def node_argv(self) -> list[str]:
        """The node flags of the values given (the nodes take vLLM's names too)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            flag = "--" + f.name.replace("_", "-")
            if value is True:
                argv.append(flag)
            elif value is False and f.default is None:  # said off, not merely left out
                argv += [flag, "false"]
            elif value is not None and value is not False:
                argv += [flag, _DTYPES[value] if f.name == "dtype" else str(value)]
        return argv


def _router_node_tls(router_args: tuple[str, ...]) -> NodeTLS | None:
    """How the router reaches the nodes, from its ``--node-tls-*`` flags in ``--router-args``
    (None: plaintext): `up`'s node watchdog reaches them the same way."""
    from router.node_clients import NodeTLS

    parser = argparse.ArgumentParser(add_help=False)
    for flag in ("--node-tls-ca", "--node-tls-cert", "--node-tls-key", "--node-tls-server-name"):
        parser.add_argument(flag)
    known, _ = parser.parse_known_args(list(router_args))
    return NodeTLS.from_flags(
        known.node_tls_ca, known.node_tls_cert, known.node_tls_key, known.node_tls_server_name
    )


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, or the first line of ``--api-key-file`` (not both)."""
    if args.api_key_file is None:
        return args.api_key
    if args.api_key is not None:
        raise ValueError("--api-key and --api-key-file: give one")
    try:
        lines = Path(args.api_key_file).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"--api-key-file: {exc}") from None
    if not lines or not lines[0].strip():
        raise ValueError(f"--api-key-file {args.api_key_file}: no key on its first line")
    return lines[0].strip()


def _port(given: int | None, default: int) -> int:
    if given is not None and not 0 <= given < 65536:
        raise ValueError(f"ports are in [0, 65536), got {given}")
    return default if given is None else given


@dataclass(frozen=True)
class ClusterConfig:
    """What ``pdserve up`` starts. Counts are per pool; with ``autoscale`` they are the
    initial sizes, clamped into ``[min, max]``."""

    model: str = "tiny-llama"
    prefill: int = 1
    decode: int = 1
    kv_store: str = "shm"  # shm | file | redis | a store URL
    kv_store_capacity: str = "auto"  # shm/file: the store's size, see store_capacity()
    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port
    grpc_port: int = 50051
    api_key: str | None = None
    served_model_name: tuple[str, ...] = ()  # vLLM's list: the first is the name responses carry
    device: str = "auto"
    cpu_threads: int = 1
    gpus: tuple[str, ...] = ()
    prefill_tp: int = 1
    decode_tp: int = 1
    kv_cache_gb: float | None = None
    engine: EngineFlags = EngineFlags()
    autoscale: bool = False
    prefill_min: int = 1
    prefill_max: int = 4
    decode_min: int = 1
    decode_max: int = 4
    slo: str = ""
    demo: bool = False
    demo_requests: int = 24
    log_dir: str | None = None
    redis_maxmemory: str = "1gb"
    node_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()
    startup_timeout_s: float = 600.0
    node_watchdog_s: float = 30.0  # a node hung this long is killed and replaced (0: never)
    state_dir: str | None = None  # None: <cache dir>/clusters
    quiet: bool = False  # no progress lines while starting (scripts)

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        if not (self.kv_store in KV_STORES or self.kv_store.startswith(KV_URL_SCHEMES)):
            raise ValueError(
                f"--kv-store must be shm, file, redis or a store URL ({', '.join(KV_URL_SCHEMES)}"
                f"…): {self.kv_store!r}"
            )
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode must be >= 1")
        if self.cpu_threads < 1 or self.demo_requests < 1 or self.startup_timeout_s <= 0:
            raise ValueError("--cpu-threads and --demo-requests must be >= 1, timeouts > 0")
        if not self.node_watchdog_s >= 0:
            raise ValueError("--node-watchdog must be >= 0 (0: off)")
        for pool, size in (("prefill", self.prefill_tp), ("decode", self.decode_tp)):
            check_tp_fits(pool, size, self.gpu_ids())
        if self.autoscale:
            PoolLimits(self.prefill_min, self.prefill_max)  # validates the bounds
            PoolLimits(self.decode_min, self.decode_max)
        parse_slo(self.slo)  # raises ValueError on a bad spec
        if self.kv_store_capacity != "auto":
            from kv_store.url import parse_size  # not at import: `up --help` stays quick

            try:
                parse_size(self.kv_store_capacity)
            except ValueError as exc:
                raise ValueError(f"--kv-store-capacity: {exc}") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterConfig:
        free_ports = args.demo  # a demo runs anywhere: it never needs the well-known ports
        d = cls()
        if args.kv_cache_dtype == "fp8_e5m2":
            raise ValueError("--kv-cache-dtype fp8_e5m2: not supported; use fp8 (e4m3)")
        both_tp = args.tensor_parallel_size  # vLLM's -tp: both pools, unless a pool flag says
        return cls(
            model=args.model, prefill=args.prefill, decode=args.decode, kv_store=args.kv_store,
            kv_store_capacity=args.kv_store_capacity, host=args.host,
            port=_port(args.port, 0 if free_ports else d.port),
            grpc_port=_port(args.grpc_port, 0 if free_ports else d.grpc_port),
            api_key=_api_key(args), served_model_name=tuple(args.served_model_name or ()),
            engine=EngineFlags.from_args(args), device=args.device, cpu_threads=args.cpu_threads,
            gpus=tuple(g.strip() for g in (args.gpus or "").split(",") if g.strip()),
            prefill_tp=_first(args.prefill_tp, both_tp, d.prefill_tp),
            decode_tp=_first(args.decode_tp, both_tp, d.decode_tp),
            kv_cache_gb=args.kv_cache_gb, autoscale=args.autoscale,
            prefill_min=args.prefill_min, prefill_max=args.prefill_max,
            decode_min=args.decode_min, decode_max=args.decode_max, slo=args.slo,
            demo=args.demo, demo_requests=args.demo_requests, log_dir=args.log_dir,
            redis_maxmemory=args.redis_maxmemory, node_args=tuple(shlex.split(args.node_args)),
            router_args=tuple(shlex.split(args.router_args)),
            startup_timeout_s=args.startup_timeout, state_dir=args.state_dir, quiet=args.quiet,
            node_watchdog_s=args.node_watchdog,
        )  # fmt: skip

    def device_name(self) -> str:
        """The device nodes run on: ``--device``, with ``auto`` resolved."""
        if self.device != "auto":
            return self.device
        return "cuda" if cuda_present() else "cpu"

    def max_nodes(self) -> int:
        if self.autoscale:
            return self.prefill_max + self.decode_max
        return self.prefill + self.decode

    def gpu_ids(self) -> tuple[str, ...]:
        """``--gpus``, or on CUDA the GPUs ``up`` itself may use: its ``CUDA_VISIBLE_DEVICES``
        when set, else every GPU found (``0…n-1``); none on CPU."""
        if self.gpus or not self.device_name().startswith("cuda"):
            return self.gpus
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        if visible:
            return tuple(g.strip() for g in visible.split(",") if g.strip())
        return tuple(str(i) for i in range(count_gpus()))

    def max_gpu_slots(self) -> int:
        """GPUs the nodes take at most (a TP=N node takes N)."""
        if self.autoscale:
            return self.prefill_max * self.prefill_tp + self.decode_max * self.decode_tp
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp

    def node_argv(self) -> list[str]:
        """Engine flags every node gets, before the user's ``--node-args``."""
        device = self.device_name()
        argv = ["--device", device]
        if device == "cpu":
            argv += ["--cpu-threads", str(self.cpu_threads)]
        sharing = math.ceil(self.max_gpu_slots() / max(1, len(self.gpu_ids())))
        kv_gb = self.kv_cache_gb
        if kv_gb is None and device.startswith("cuda") and sharing > 1:
            kv_gb = 4.0  # several nodes per GPU: bound each one (raise it with --kv-cache-gb)
        if kv_gb is not None:
            argv += ["--kv-cache-memory-gb", f"{kv_gb:g}"]
        return argv + self.engine.node_argv() + list(self.node_args)

    def store_capacity(self) -> str:
        """The local (shm/file) store's size: ``--kv-store-capacity``, or for ``auto`` twice a
        node's KV cache: ``2 × --kv-cache-gb``, else 1 GiB on CPU (a CPU node's cache is 0.5 GiB
        by default) and 4 GiB on GPUs. The shm arena is allocated and mapped up front by every
        node, so a store far larger than the caches it serves only slows the start (a 4 GiB
        arena took 12 s of a CPU cluster's start; docs/BENCHMARKS.md)."""
        if self.kv_store_capacity != "auto":
            return self.kv_store_capacity
        if self.kv_cache_gb is not None:
            return f"{2 * self.kv_cache_gb:g}GiB"
        return "1GiB" if self.device_name() == "cpu" else "4GiB"

    def node_tls(self) -> NodeTLS | None:
        """How the router reaches the nodes (its ``--node-tls-*`` in ``--router-args``)."""
        return _router_node_tls(self.router_args)

    def router_argv(self) -> list[str]:
        """Serving flags the router gets (the API key goes through its environment)."""
        if self.served_model_name:
            return ["--served-model-name", *self.served_model_name]
        return []

    @property
    def served_name(self) -> str:
        """The model name clients ask for (the first served name)."""
        return self.served_model_name[0] if self.served_model_name else self.model


def check_model(config: ClusterConfig) -> str:
    """Refuse (ValueError, one line) what the model's ``config.json`` and the flags rule out,
    before any process starts: an architecture pdserve has no code for (or not at the pools'
    tensor-parallel sizes: a mixture-of-experts model), a ``--max-model-len``
    past the model's, a speculative config that does not parse or names a draft model that
    cannot serve. Resolving the model generates a built-in one (in a child process: `up`
    imports no torch) or finds a Hub id in the HF cache. Returns what was found, for the
    progress line."""
    import json

    from common.models.names import resolve_model_path
    from common.models.preflight import architecture, check_tensor_parallel, max_model_len

    def read(model: str) -> dict:
        try:
            path = resolve_model_path(model)
        except RuntimeError as exc:
            raise ValueError(str(exc)) from None
        try:
            return json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{model}: unreadable config.json ({exc})") from None

    hf_config = read(config.model)
    arch = architecture(hf_config)
    check_tensor_parallel(
        hf_config, max(config.prefill_tp, config.decode_tp), config.engine.enable_expert_parallel
    )
    context = max_model_len(hf_config, config.engine.max_model_len)
    spec = config.engine.speculative_config
    if spec:
        from common.spec_decode.config import SpeculativeConfig

        try:
            values = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        speculative = SpeculativeConfig.from_dict(values)
        if speculative.model is not None:
            architecture(read(speculative.model))
    return f"{arch}, context {context} tokens"


def _first(*values: int | None) -> int:
    """The first value given."""
    return next(v for v in values if v is not None)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``up`` flags."""
    d = ClusterConfig()
    a = parser.add_argument
    a("--model", default=d.model, help="built-in name or HF model directory (default tiny-llama)")
    a(
        "--prefill",
        type=int,
        default=d.prefill,
        help="prefill instances (initial, with --autoscale)",
    )
    a("--decode", type=int, default=d.decode, help="decode instances (initial, with --autoscale)")
    a("--kv-store", default=d.kv_store,
      help="shm (one shared-memory arena, default), file (a file per entry), redis (a private"
           " redis-server), or a store URL")  # fmt: skip
    a("--kv-store-capacity", default=d.kv_store_capacity,
      help="shm/file store size, e.g. 8GiB (default auto: twice a node's KV cache, 1GiB on"
           " CPU, 4GiB on GPU; at most a quarter of /dev/shm)")  # fmt: skip
    a("--host", default=d.host, help="router bind address (default 127.0.0.1; nodes stay on it)")
    a(
        "--port",
        type=int,
        default=None,
        help=f"router HTTP port (default {d.port}; with --demo a free one; 0: any free port)",
    )
    a(
        "--grpc-port",
        type=int,
        default=None,
        help=f"router gRPC port (default {d.grpc_port}; with --demo a free one; 0: any free port)",
    )
    a(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' at the router"
        " (visible to every user in ps: prefer --api-key-file)",
    )
    a(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="--api-key read from this file (its first line), kept out of the command line",
    )
    a("--served-model-name", nargs="+", default=None,
      help="the model's names in the API, the first in responses (default --model)")  # fmt: skip
    add_engine_arguments(parser)
    a("--device", default=d.device, help="auto, cpu, cuda (default auto)")
    a("--cpu-threads", type=int, default=d.cpu_threads, help="torch threads per CPU node")
    a(
        "--gpus",
        default="",
        help="GPU ids to spread nodes over, e.g. 0,1,2,3 (default: CUDA_VISIBLE_DEVICES, else all)",
    )
    a("-tp", "--tensor-parallel-size", type=int, default=None,
      help="tensor-parallel size of every node (vLLM's flag; --prefill-tp/--decode-tp win)")  # fmt: skip
    a("--prefill-tp", type=int, default=None,
      help="tensor-parallel size of each prefill node (its GPUs; default 1)")  # fmt: skip
    a("--decode-tp", type=int, default=None,
      help="tensor-parallel size of each decode node (its GPUs; default 1)")  # fmt: skip
    a("--kv-cache-gb", type=float, default=None, help="KV cache per node (GiB)")
    a("--autoscale", action="store_true", help="let the router size both pools from load")
    for pool in ("prefill", "decode"):
        a(f"--{pool}-min", type=int, default=getattr(d, f"{pool}_min"), help="with --autoscale")
        a(f"--{pool}-max", type=int, default=getattr(d, f"{pool}_max"), help="with --autoscale")
    a("--slo", default="", help="SLOs in ms, e.g. ttft=500,tpot=50 (router report, autoscaler)")
    a("--demo", action="store_true", help="send sample requests and a short load, report, stop")
    a("--demo-requests", type=int, default=d.demo_requests, help="requests of the demo's load")
    a("--log-dir", default=None, help="keep every process's log here (default: removed at exit)")
    a("--redis-maxmemory", default=d.redis_maxmemory, help="--kv-store redis: its maxmemory")
    a("--node-args", default="", help='more node flags, e.g. "--max-num-seqs 64"')
    a("--router-args", default="", help='more router flags, e.g. "--scale-down-delay 10"')
    a("--startup-timeout", type=float, default=d.startup_timeout_s, help="seconds per start")
    a("--node-watchdog", type=float, default=d.node_watchdog_s,
      help="kill and replace a node that holds requests while its engine makes no progress, or"
           " that does not answer, for this long (s; 0: off; the router moves its requests"
           " sooner, at its --progress-timeout)")  # fmt: skip
    a("--quiet", action="store_true", help="no progress lines while the cluster starts")
    a(
        "--state-dir",
        default=None,
        help="where `up` records its cluster for `pdserve down` (default <cache dir>/clusters)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's engine flags; every node gets the ones given."""
    g = parser.add_argument_group("engine (every node; vLLM's flags)").add_argument
    g(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's)",
    )
    g("--block-size", type=int, default=None, help="tokens per KV-cache block (default 16)")
    g(
        "--dtype",
        default=None,
        choices=list(_DTYPES),
        help="weights and activations (default auto: the checkpoint's)",
    )
    g("--max-num-seqs", type=int, default=None, help="requests running at once per node")
    g("--max-num-batched-tokens", type=int, default=None, help="token budget of one step")
    g(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="share of GPU memory a node may use (default 0.9)",
    )
    g("--enforce-eager", action="store_true", help="no CUDA graphs (GPU)")
    g("--quantization", choices=["fp8"], default=None,
      help="fp8: the projections as FP8 GEMMs, quantized at load (FP8 checkpoints: automatic)")  # fmt: skip
    g("--enable-expert-parallel", action="store_true",
      help="a MoE model at tensor-parallel size > 1: shard its experts whole over the ranks")  # fmt: skip
    g("--seed", type=int, default=None, help="seed of the engines' request seeds (default 0)")
    g("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
      help="reuse cached prompt blocks (default on)")  # fmt: skip
    g("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
      help="schedule the next step while one runs (default: on for CUDA)")  # fmt: skip
    g("--kv-cache-dtype", default=None, choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
      help="KV cache dtype: auto (the model's) or fp8 (e4m3, half the bytes of bf16 in the"
           " cache and in every transfer; e5m2 is refused)")  # fmt: skip
    g("--enable-lora", action="store_true", help="serve LoRA adapters beside the base model")
    g("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
      help="PEFT LoRA adapters every node serves, chosen by a request's model")  # fmt: skip
    g("--max-loras", type=int, default=None,
      help="adapters resident on a node's device, and per step (default 4)")  # fmt: skip
    g("--max-lora-rank", type=int, default=None, help="largest LoRA rank (default 16)")
    g("--trust-remote-code", action="store_true",
      help="accepted for vLLM's command lines: pdserve runs only its own code for the"
           " architectures it supports, never a checkpoint's")  # fmt: skip
    g(
        "--speculative-config",
        default=None,
        help='speculative decoding on the decode nodes, vLLM\'s JSON, e.g. \'{"method": "ngram",'
        ' "num_speculative_tokens": 3}\'',
    )
