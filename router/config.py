"""``RouterConfig``: every router setting, validated at construction, and its CLI flags.

Flags have ``PDSERVE_<FLAG>`` environment overrides (``PDSERVE_API_KEY``, ``PDSERVE_PORT``…),
read once when the parser is built; an explicit flag wins over the environment.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from typing import Any

from bench.slo import SLOConfig, parse_slo
from common.config import check_bind_host, env_overrides
from router.balancer import DECODE_POLICIES, PREFILL_POLICIES


@dataclass(frozen=True)
class RouterConfig:
    """How the router listens, whom it routes to, and what it accepts."""

    model: str = "tiny-llama"
    served_model_name: str | None = None
    # more names clients may ask for (vLLM's --served-model-name takes a list: the first is
    # the one responses carry)
    served_model_aliases: tuple[str, ...] = ()
    tokenizer: str | None = None  # default: the model's directory
    # A cap on the nodes' context (a node with a shorter one is refused); default: the nodes'.
    max_model_len: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000  # HTTP; 0 picks a free port
    grpc_port: int = 50051  # 0 picks a free port
    prefill: tuple[str, ...] = ()  # static instances (host:port)
    decode: tuple[str, ...] = ()
    heartbeat_interval_s: float = 2.0
    heartbeat_timeout_s: float = 10.0
    poll_interval_s: float = 2.0
    prefill_policy: str = "cache_aware"
    decode_policy: str = "least_load"
    # Deprecated: the nodes report their block size. Set, it is checked against them.
    block_size: int | None = None
    max_retries: int = 3
    quarantine_after: int = 3  # instances a request may fail before it is refused
    prefill_timeout_s: float = 300.0
    decode_stall_timeout_s: float = 300.0
    # a node holding requests whose engine makes no progress this long is stalled (out of
    # routing, its requests move); also a decode stream's per-token deadline (router.deadlines)
    progress_timeout_s: float = 10.0
    prefill_fallback: bool = True  # no prefill path: a decode node runs the request whole
    max_inflight: int = 1024
    max_n: int = 8
    max_logprobs: int = 20
    max_prompt_tokens: int | None = None  # None: the nodes' context is the only bound
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 16 * 2**10
    max_json_depth: int = 64  # JSON bodies nested deeper are refused before parsing
    # Idle HTTP keep-alive connections are closed after this long. It must outlast the idle
    # expiry of clients' connection pools (httpx and so the openai client: 5 s), or a client
    # reusing a connection just as the server closes it gets "connection reset" for a request
    # the router never saw.
    http_keep_alive_s: float = 75.0
    api_key: str | None = None
    node_key: str | None = None  # Register/Heartbeat/Deregister; None: the api_key
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    node_tls_ca: str | None = None
    node_tls_cert: str | None = None
    node_tls_key: str | None = None
    node_tls_server_name: str | None = None  # the name nodes' certificates carry (else: address)
    slo: SLOConfig = field(default_factory=SLOConfig)
    slo_window_s: float = 60.0

    def __post_init__(self) -> None:
        check_bind_host(self.host)
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ValueError(f"prefill policy must be one of {sorted(PREFILL_POLICIES)}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode policy must be one of {sorted(DECODE_POLICIES)}")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < --heartbeat-interval < --heartbeat-timeout")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("--tls-client-ca needs --tls-cert/--tls-key")
        if self.node_tls_server_name and not self.node_tls_ca:
            raise ValueError("--node-tls-server-name needs --node-tls-ca")
        if (self.node_tls_cert or self.node_tls_key) and not self.node_tls_ca:
            raise ValueError("--node-tls-cert/--node-tls-key need --node-tls-ca")
        positive = ("max_inflight", "max_n", "max_body_bytes", "max_header_bytes", "max_json_depth")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("block_size", "max_model_len", "max_prompt_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.http_keep_alive_s <= 0:
            raise ValueError("http_keep_alive_s must be > 0")
        if self.max_retries < 0 or self.max_logprobs < 0:
            raise ValueError("max_retries and max_logprobs must be >= 0")
        if self.quarantine_after < 1:
            raise ValueError("quarantine_after must be >= 1")
        if self.progress_timeout_s <= 0:
            raise ValueError("--progress-timeout must be > 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        names = {f.name for f in fields(cls)}
        values: dict[str, Any] = {k: v for k, v in vars(args).items() if k in names}
        values["prefill"] = _addresses(args.prefill)
        values["decode"] = _addresses(args.decode)
        values["slo"] = parse_slo(args.slo or "")
        names = args.served_model_name  # a list from the flag, a string from PDSERVE_*
        if isinstance(names, str):
            names = names.split()
        values["served_model_name"] = names[0] if names else None
        values["served_model_aliases"] = tuple(names[1:]) if names else ()
        if isinstance(values.get("prefill_fallback"), str):  # PDSERVE_PREFILL_FALLBACK=0
            values["prefill_fallback"] = values["prefill_fallback"].lower() in (
                "1",
                "true",
                "yes",
                "on",
            )
        return cls(**values)


def _addresses(text: str | None) -> tuple[str, ...]:
    return tuple(a.strip() for a in (text or "").split(",") if a.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The router's flags (defaults from RouterConfig, then PDSERVE_* overrides)."""
    d = RouterConfig()
    a = parser.add_argument
    a("--model", default=d.model, help="built-in name or HF model directory")
    a("--served-model-name", nargs="+", default=None,
      help="the model's names in the API, the first one in responses (default: --model; when"
           " given, only these names are served)")  # fmt: skip
    a("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    a("--max-model-len", type=int, default=None,
      help="cap on the context (default: the nodes'); a node with less is refused")  # fmt: skip
    a("--host", default=d.host, help="bind address for HTTP and gRPC (default 127.0.0.1)")
    a("--port", type=int, default=d.port, help="HTTP port (0: any free port)")
    a("--grpc-port", type=int, default=d.grpc_port, help="gRPC port (0: any free port)")
    a("--prefill", default="", help="static prefill instances, ADDR,ADDR")
    a("--decode", default="", help="static decode instances, ADDR,ADDR")
    a("--heartbeat-interval", dest="heartbeat_interval_s", type=float, default=2.0)
    a("--heartbeat-timeout", dest="heartbeat_timeout_s", type=float, default=10.0,
      help="drop a registered instance silent this long (s)")  # fmt: skip
    a("--poll-interval", dest="poll_interval_s", type=float, default=2.0,
      help="how often static instances are polled (s)")  # fmt: skip
    a("--prefill-policy", choices=sorted(PREFILL_POLICIES), default=d.prefill_policy)
    a("--decode-policy", choices=sorted(DECODE_POLICIES), default=d.decode_policy)
    a("--block-size", type=int, default=None,
      help="deprecated: nodes report their block size; set, a node with another is refused")  # fmt: skip
    a("--max-retries", type=int, default=d.max_retries, help="retries per prefill / decode")
    a("--quarantine-after", type=int, default=d.quarantine_after,
      help="refuse a request (and its resends) once this many instances failed running it")  # fmt: skip
    a("--prefill-timeout", dest="prefill_timeout_s", type=float, default=d.prefill_timeout_s)
    a("--decode-stall-timeout", dest="decode_stall_timeout_s", type=float,
      default=d.decode_stall_timeout_s,
      help="resume elsewhere after this long without output, even from a live, full node")  # fmt: skip
    a("--progress-timeout", dest="progress_timeout_s", type=float, default=d.progress_timeout_s,
      help="a node holding requests whose engine makes no progress this long is stalled: out"
           " of routing and /ready, its requests resume elsewhere; also the per-token deadline"
           " of a decode stream (s)")  # fmt: skip
    a("--prefill-fallback", action=argparse.BooleanOptionalAction, default=d.prefill_fallback,
      help="when no prefill instance can serve, a decode node prefills locally (default on)")  # fmt: skip
    a("--max-inflight", type=int, default=d.max_inflight, help="over it: 429")
    a("--max-n", type=int, default=d.max_n)
    a("--max-logprobs", type=int, default=d.max_logprobs)
    a("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
      help="longest prompt accepted, in tokens (default: the nodes' context)")  # fmt: skip
    a("--max-body-bytes", type=int, default=d.max_body_bytes)
    a("--max-header-bytes", type=int, default=d.max_header_bytes)
    a("--max-json-depth", type=int, default=d.max_json_depth,
      help="deepest JSON nesting accepted in a request body (deeper: 400)")  # fmt: skip
    a("--http-keep-alive", dest="http_keep_alive_s", type=float, default=d.http_keep_alive_s,
      help="seconds an idle HTTP connection stays open (above clients' pool expiry)")  # fmt: skip
    a("--api-key", default=None, help="require Bearer KEY (or set PDSERVE_API_KEY)")
    a("--node-key", default=None,
      help="key nodes must present to register and heartbeat (default: --api-key; or set"
           " PDSERVE_NODE_KEY, which keeps it off the command line)")  # fmt: skip
    a("--tls-cert", default=None, help="gRPC and HTTP server certificate (PEM)")
    a("--tls-key", default=None, help="its private key (PEM)")
    a("--tls-client-ca", default=None, help="require gRPC client certs signed by this CA")
    a("--node-tls-ca", default=None, help="verify nodes with this CA (TLS towards nodes)")
    a("--node-tls-cert", default=None, help="client certificate towards nodes")
    a("--node-tls-key", default=None, help="its private key")
    a("--node-tls-server-name", default=None,
      help="verify every node's certificate for this name, not its address (nodes advertise"
           " addresses no certificate names: container IPs)")  # fmt: skip
    a("--slo", default="", help="SLOs in ms, e.g. ttft=500,tpot=50,itl=200,e2e=10000")
    a("--slo-window", dest="slo_window_s", type=float, default=d.slo_window_s)
    _apply_env_overrides(parser)


def _apply_env_overrides(parser: argparse.ArgumentParser) -> None:
    """``PDSERVE_HEARTBEAT_TIMEOUT=5`` becomes the default of ``--heartbeat-timeout``."""
    by_flag = {
        option.lstrip("-").replace("-", "_"): action.dest
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and action.dest != "help"
    }
    env = env_overrides()
    parser.set_defaults(**{by_flag[k]: v for k, v in env.items() if k in by_flag})
