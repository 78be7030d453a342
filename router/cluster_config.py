"""``pdserve up`` flags and the :class:`ClusterConfig` they make.

`up` is configured by its flags only: it scrubs ``PDSERVE_*`` variables from its children and
passes each setting explicitly (``PDSERVE_*`` variables configure the individual services, as
compose.yaml does).

Device: ``--device auto`` means CUDA when an NVIDIA device node exists, else CPU. CPU nodes get
``--cpu-threads 1`` (a node on a shared small machine runs best on one torch thread); GPU nodes
are spread over ``--gpus`` (``CUDA_VISIBLE_DEVICES`` round-robin), and when several share one
GPU, ``--kv-cache-gb`` caps each node's KV cache (the engine's default takes 90% of free memory,
which only one node can do).
"""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass
from pathlib import Path

from router.autoscaler import PoolLimits
from router.slo import parse_slo

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
    return any(Path("/dev").glob("nvidia[0-9]*"))


@dataclass(frozen=True)
class ClusterConfig:
    """What ``pdserve up`` starts. Counts are per pool; with ``autoscale`` they are the
    initial sizes, clamped into ``[min, max]``."""

    model: str = "tiny-llama"
    prefill: int = 1
    decode: int = 1
    kv_store: str = "shm"  # shm | file | redis | a store URL
    kv_store_capacity: str = "4GiB"  # shm/file: the store's size (capped to a quarter of tmpfs)
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    api_key: str | None = None
    device: str = "auto"
    cpu_threads: int = 1
    gpus: tuple[str, ...] = ()
    kv_cache_gb: float | None = None
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

    def __post_init__(self) -> None:
        if not (self.kv_store in KV_STORES or self.kv_store.startswith(KV_URL_SCHEMES)):
            raise ValueError(
                f"--kv-store must be shm, file, redis or a store URL ({', '.join(KV_URL_SCHEMES)}"
                f"…): {self.kv_store!r}"
            )
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode must be >= 1")
        if self.cpu_threads < 1 or self.demo_requests < 1 or self.startup_timeout_s <= 0:
            raise ValueError("--cpu-threads and --demo-requests must be >= 1, timeouts > 0")
        if self.autoscale:
            PoolLimits(self.prefill_min, self.prefill_max)  # validates the bounds
            PoolLimits(self.decode_min, self.decode_max)
        parse_slo(self.slo)  # raises ValueError on a bad spec

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ClusterConfig:
        return cls(
            model=args.model, prefill=args.prefill, decode=args.decode, kv_store=args.kv_store,
            kv_store_capacity=args.kv_store_capacity,
            host=args.host, port=args.port, grpc_port=args.grpc_port, api_key=args.api_key,
            device=args.device, cpu_threads=args.cpu_threads,
            gpus=tuple(g.strip() for g in (args.gpus or "").split(",") if g.strip()),
            kv_cache_gb=args.kv_cache_gb, autoscale=args.autoscale,
            prefill_min=args.prefill_min, prefill_max=args.prefill_max,
            decode_min=args.decode_min, decode_max=args.decode_max, slo=args.slo,
            demo=args.demo, demo_requests=args.demo_requests, log_dir=args.log_dir,
            redis_maxmemory=args.redis_maxmemory, node_args=tuple(shlex.split(args.node_args)),
            router_args=tuple(shlex.split(args.router_args)),
            startup_timeout_s=args.startup_timeout,
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

    def node_argv(self) -> list[str]:
        """Engine flags every node gets, before the user's ``--node-args``."""
        device = self.device_name()
        argv = ["--device", device]
        if device == "cpu":
            argv += ["--cpu-threads", str(self.cpu_threads)]
        sharing = math.ceil(self.max_nodes() / max(1, len(self.gpus)))
        kv_gb = self.kv_cache_gb
        if kv_gb is None and device.startswith("cuda") and sharing > 1:
            kv_gb = 4.0  # several nodes per GPU: bound each one (raise it with --kv-cache-gb)
        if kv_gb is not None:
            argv += ["--kv-cache-memory-gb", f"{kv_gb:g}"]
        return argv + list(self.node_args)


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
      help="shm/file store size, e.g. 8GiB (default 4GiB, at most a quarter of /dev/shm)")  # fmt: skip
    a("--host", default=d.host, help="router bind address (default 127.0.0.1; nodes stay on it)")
    a("--port", type=int, default=d.port, help="router HTTP port (0: any free port)")
    a("--grpc-port", type=int, default=d.grpc_port, help="router gRPC port (0: any free port)")
    a("--api-key", default=None, help="require 'Authorization: Bearer KEY' at the router")
    a("--device", default=d.device, help="auto, cpu, cuda (default auto)")
    a("--cpu-threads", type=int, default=d.cpu_threads, help="torch threads per CPU node")
    a("--gpus", default="", help="GPU ids to spread nodes over, e.g. 0,1,2,3")
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
