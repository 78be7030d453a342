"""Node flags, ``PDSERVE_*`` environment overrides, and the engine config they make.

Precedence: a flag given on the command line, else ``PDSERVE_<FLAG>`` (``--kv-store`` ↔
``PDSERVE_KV_STORE``), else the default. The environment is read once, in
:func:`options_from_args`.
"""

from __future__ import annotations

import argparse
import json
import socket
from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import EngineConfig, LoraConfig, check_bind_host, env_overrides
from common.lora.adapter import LoraRef, parse_lora_modules, read_adapter
from common.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    import grpc

PREFILL_PORT = 50061
DECODE_PORT = 50071


# NodeOptions fields handed to the engine as they are (when set)
ENGINE_OPTIONS = (
    "max_num_batched_tokens",
    "max_num_seqs",
    "num_blocks",
    "block_size",
    "dtype",
    "device",
    "max_model_len",
    "cpu_threads",
    "kv_cache_memory_gb",
    "kv_offload_gb",
    "kv_cache_dtype",
    "gpu_memory_utilization",
    "enforce_eager",
    "enable_expert_parallel",
    "quantization",
    "async_scheduling",
    "tensor_parallel_size",
    "seed",
    "enable_prefix_caching",
    "enable_lora",
    "max_loras",
    "max_lora_rank",
)


@dataclass(frozen=True)
class NodeOptions:
    """Everything a node process is started with. Engine fields left ``None`` keep the engine's
    own defaults."""

    kv_store: str  # redis://… or file:///…
    port: int  # 0: an ephemeral port (reported on stdout as ``PDSERVE_READY port=N``)
    model: str = "tiny-llama"
    host: str = "127.0.0.1"
    advertise_address: str | None = None  # host:port the router should call; default host:port
    router: str | None = None  # router gRPC address to register with
    router_tls_ca: str | None = None  # CA of a router serving TLS (enables TLS registration)
    router_tls_cert: str | None = None  # this node's certificate, for a mutual-TLS router
    router_tls_key: str | None = None
    tls_cert: str | None = None  # serve TLS with this certificate (the router's --node-tls-ca)
    tls_key: str | None = None
    tls_client_ca: str | None = None  # require client certificates signed by this CA (mTLS)
    node_key: str | None = None  # the router's node key (sent as Bearer with every call)
    max_queue: int = 1024  # requests admitted beyond max_num_seqs; over it: RESOURCE_EXHAUSTED
    drain_timeout: float = 30.0  # seconds to finish in-flight work after SIGTERM/SIGINT
    startup_timeout: float = 600.0  # seconds for the engine core to come up
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    num_blocks: int | None = None
    block_size: int | None = None
    dtype: str | None = None
    device: str | None = None
    max_model_len: int | None = None
    cpu_threads: int | None = None
    kv_cache_memory_gb: float | None = None
    kv_offload_gb: float | None = None
    kv_cache_dtype: str | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool | None = None
    enable_expert_parallel: bool | None = None
    quantization: str | None = None
    async_scheduling: bool | None = None
    tensor_parallel_size: int | None = None
    seed: int | None = None
    enable_prefix_caching: bool | None = None
    speculative_config: str | None = None  # vLLM's JSON (decode nodes; a prefill makes 1 token)
    enable_lora: bool | None = None
    max_loras: int | None = None
    max_lora_rank: int | None = None
    lora_modules: str | None = None  # "name=path name=path …" (or comma-separated)

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        if self.speculative_config:
            self.speculative()  # a bad JSON or config fails at start-up, with its reason
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        _ = self.lora_adapters  # read once, here: an adapter it cannot serve fails start-up
        if not self.kv_store:
            raise ValueError("--kv-store is required (redis://… or file:///…)")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.drain_timeout < 0 or self.startup_timeout <= 0:
            raise ValueError("drain_timeout must be >= 0 and startup_timeout > 0")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert/--tls-key")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials of the node's port (None: plaintext)."""
        import grpc

        if not self.tls_cert or not self.tls_key:
            return None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                           require_client_auth=ca is not None)  # fmt: skip

    def engine_config(self, kv_role: str) -> EngineConfig:
        """The engine of this node; its waiting bound never trips before the node's own."""
        names = ENGINE_OPTIONS
        kwargs: dict[str, Any] = {
            n: getattr(self, n) for n in names if getattr(self, n) is not None
        }
        if self.speculative_config and kv_role == "consumer":
            # decode nodes only: a prefill samples one token, a draft model would only take memory
            kwargs["speculative_config"] = self.speculative()
        max_waiting = (self.max_num_seqs or 256) + self.max_queue
        kwargs["prepare_structured_outputs"] = True  # a node's first grammar never waits
        return EngineConfig.from_kwargs(
            model=self.model,
            kv_store=self.kv_store,
            kv_role=kv_role,
            max_waiting=max(1, max_waiting),
            **kwargs,
        )

    @cached_property
    def lora_adapters(self) -> dict[str, LoraRef]:
        """``--lora-modules`` read and checked: name → adapter (reads and hashes the files,
        once: the node's runtime starts from a copy)."""
        specs = (self.lora_modules or "").replace(",", " ").split()
        rank = self.max_lora_rank or LoraConfig.max_lora_rank
        return {
            name: read_adapter(name, path, rank)[0]
            for name, path in parse_lora_modules(specs).items()
        }

    def speculative(self) -> SpeculativeConfig:
        """``--speculative-config`` parsed. Raises ValueError on bad JSON or a bad config."""
        try:
            values = json.loads(self.speculative_config or "")
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError("--speculative-config must be a JSON object")
        return SpeculativeConfig.from_dict(values)

    def address(self, bound_port: int) -> str:
        """Where the router should call: ``--advertise-address``, else host:port - with a
        wildcard host (0.0.0.0, ::) replaced by this machine's address towards the router (a
        container on several networks has one address per network: the router reaches only
        the one on its own), else the address of its hostname. Asked again at every
        registration: a container reconnected to a network may have a new address."""
        if self.advertise_address:
            return self.advertise_address
        host = self.host
        if host in ("0.0.0.0", "::"):  # asked for by name (compose, inside a container)
            host = route_address(self.router) or hostname_address()
        return f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"


def route_address(target: str | None) -> str | None:
    """This machine's source address for packets to ``target`` (host:port), from the routing
    table (a UDP connect sends nothing); None when there is no target or no route."""
    if not target:
        return None
    host, _, port = target.rpartition(":")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), int(port), type=socket.SOCK_DGRAM
        )[0]
        with socket.socket(family, kind, proto) as sock:
            sock.connect(address)
            return str(sock.getsockname()[0])
    except (OSError, ValueError):
        return None


def hostname_address() -> str:
    """The address this machine's hostname resolves to (else the hostname itself)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:  # an unresolvable hostname: let the router resolve it
        return socket.gethostname()


# (flag, converter, help); the option name is the flag without dashes, '-' → '_'
_FLAGS: list[tuple[str, Callable[[str], Any] | str, str]] = [
    ("--model", str, "built-in model name or HF directory (default tiny-llama)"),
    (
        "--kv-store",
        str,
        "KV store URL: shm:///dir, file:///dir, redis://host:port/db, redis+cluster://… (required)",
    ),
    ("--host", str, "address to bind (default 127.0.0.1)"),
    ("--port", int, "port to bind; 0 = ephemeral (default: {port})"),
    ("--advertise-address", str, "host:port the router should call (default host:port)"),
    ("--router", str, "router gRPC address (host:port) to register with"),
    ("--router-tls-ca", str, "CA file of a router whose gRPC port serves TLS"),
    ("--router-tls-cert", str, "this node's certificate for a mutual-TLS router"),
    ("--router-tls-key", str, "this node's private key for a mutual-TLS router"),
    ("--tls-cert", str, "serve TLS with this certificate (PEM; the router's --node-tls-ca)"),
    ("--tls-key", str, "its private key (PEM)"),
    ("--tls-client-ca", str, "require client certificates signed by this CA (mutual TLS)"),
    ("--node-key", str, "the router's node key (its --node-key or --api-key); prefer the env"),
    ("--max-queue", int, "requests admitted beyond --max-num-seqs (default 1024)"),
    ("--drain-timeout", float, "seconds to finish in-flight work on SIGTERM (default 30)"),
    ("--startup-timeout", float, "seconds to wait for the engine core (default 600)"),
    ("--max-num-batched-tokens", int, "engine token budget per step"),
    ("--max-num-seqs", int, "engine: requests running at once"),
    ("--num-blocks", int, "engine: KV cache blocks (default: from the memory budget)"),
    ("--block-size", int, "engine: tokens per KV block (default 16)"),
    ("--dtype", str, "engine: auto, float32, bfloat16 or float16"),
    ("--device", str, "engine: auto, cpu, cuda, cuda:N"),
    ("--max-model-len", int, "engine: longest prompt + output (default: the model's)"),
    ("--cpu-threads", int, "engine (CPU): torch threads of the engine process"),
    ("--kv-cache-memory-gb", float, "engine: KV cache size in GiB (default: from free memory)"),
    ("--kv-offload-gb", float, "engine: host memory for KV blocks evicted from the cache (GiB)"),
    ("--kv-cache-dtype", str, "engine: auto (the model's dtype) or fp8 (e4m3 KV cache, scaled)"),
    ("--gpu-memory-utilization", float, "engine (CUDA): share of GPU memory to use (default 0.9)"),
    ("--enforce-eager", "flag", "engine (CUDA): no decode CUDA graphs"),
    ("--enable-expert-parallel", "flag", "engine: a MoE model's experts sharded over the TP ranks"),
    ("--quantization", str, "engine: fp8 = the projections as FP8 GEMMs, quantized at load"),
    ("--async-scheduling", "flag", "engine: schedule the next step while one runs (default: CUDA)"),
    ("--tensor-parallel-size", int, "engine: ranks the model is split over (default 1)"),
    ("--seed", int, "engine: seed of its per-request seeds and dummy weights (default 0)"),
    ("--enable-prefix-caching", "flag", "engine: reuse cached prompt blocks (default true)"),
    ("--enable-lora", "flag", "engine: serve LoRA adapters (PEFT) beside the base model"),
    (
        "--lora-modules",
        str,
        "LoRA adapters to serve: 'name=path name=path …' (needs --enable-lora)",
    ),
    ("--max-loras", int, "engine: LoRA adapters resident on the device, and per step (default 4)"),
    ("--max-lora-rank", int, "engine: largest LoRA rank served (default 16)"),
    (
        "--speculative-config",
        str,
        'engine (decode): speculative decoding, vLLM\'s JSON, e.g. \'{{"method": "ngram",'
        ' "num_speculative_tokens": 3}}\'',
    ),
]


def _truth(text: str) -> bool:
    """A flag's value: ``--enforce-eager`` alone is true; ``true/false/1/0/yes/no`` spelled."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _name(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_node_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Add the flags every node takes. Defaults are applied later (so env can override)."""
    for flag, convert, text in _FLAGS:
        env = "PDSERVE_" + _name(flag).upper()
        help_text = f"{text} [{env}]".format(port=default_port)
        if convert == "flag":
            parser.add_argument(
                flag, type=_truth, nargs="?", const=True, default=None, help=help_text
            )
        else:
            parser.add_argument(flag, type=convert, default=None, help=help_text)


def options_from_args(
    args: argparse.Namespace, default_port: int, env: dict[str, str] | None = None
) -> NodeOptions:
    """Merge flags, environment (``env``, default: ``PDSERVE_*`` now) and defaults.

    Raises ValueError with the offending name on a bad value.
    """
    env = env_overrides() if env is None else env
    values: dict[str, Any] = {"port": default_port}
    for flag, convert, _ in _FLAGS:
        name = _name(flag)
        given = getattr(args, name, None)
        if given is None and name in env:
            try:
                given = (_truth if convert == "flag" else convert)(env[name])
            except ValueError as e:
                raise ValueError(f"PDSERVE_{name.upper()}={env[name]!r}: {e}") from None
        if given is not None:
            values[name] = given
    values.setdefault("kv_store", "")
    known = {f.name for f in fields(NodeOptions)}
    return NodeOptions(**{k: v for k, v in values.items() if k in known})
