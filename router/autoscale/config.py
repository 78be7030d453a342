"""The router's ``--autoscale`` flags, the settings they make, and the actuator they pick.

Every flag has a ``PDSERVE_<FLAG>`` environment override (``PDSERVE_AUTOSCALE=1``,
``PDSERVE_PREFILL_MAX=8``, ``PDSERVE_ACTUATOR=kubernetes``...), read once when the parser is
built; an explicit flag wins.

The actuators themselves are the launcher's (``launcher.actuators``): they are imported inside
the functions that build them, at start-up and only with ``--autoscale``, so importing the router
never imports the launcher (which imports only the leaves ``policy`` and ``actuator`` of here).
"""

from __future__ import annotations

import argparse
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.slo import SLOConfig
from common.config import env_overrides
from router.autoscale.actuator import Actuator
from router.autoscale.policy import AutoscalerConfig, PoolLimits

if TYPE_CHECKING:
    from launcher.actuators import ComposeTarget, KubernetesTarget
    from router.node_clients import NodeTLS

ACTUATORS = ("local", "compose", "kubernetes")
_TRUE = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class AutoscaleSettings:
    """Everything the router's autoscale loop needs (policy, cadence, actuator)."""

    policy: AutoscalerConfig = field(default_factory=AutoscalerConfig)
    interval_s: float = 2.0
    actuator: str = "local"
    node_kv_store: str | None = None  # local: the nodes' --kv-store (required)
    node_model: str | None = None  # local: default the router's --model
    node_args: tuple[str, ...] = ()
    node_log_dir: str | None = None
    node_gpus: tuple[str, ...] = ()
    node_drain_timeout_s: float = 300.0
    node_watchdog_s: float = 30.0  # local: a node hung this long is killed (0: never)
    compose: ComposeTarget | None = None  # --actuator compose (None: the defaults)
    kubernetes: KubernetesTarget | None = None  # --actuator kubernetes (None: in-cluster defaults)

    def __post_init__(self) -> None:
        if self.actuator not in ACTUATORS:
            raise ValueError(f"--actuator must be one of {ACTUATORS}, got {self.actuator!r}")
        if self.interval_s <= 0:
            raise ValueError("--autoscale-interval must be > 0")
        if self.actuator == "local" and not self.node_kv_store:
            raise ValueError("the local actuator needs --node-kv-store (the nodes' KV store)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, slo: SLOConfig) -> AutoscaleSettings | None:
        """Settings from parsed flags; None unless ``--autoscale`` was given."""
        if not args.autoscale:
            return None
        return cls(
            policy=_policy(args, slo),
            interval_s=args.autoscale_interval,
            actuator=args.actuator,
            node_kv_store=args.node_kv_store,
            node_model=args.node_model,
            node_args=tuple(shlex.split(args.node_args or "")),
            node_log_dir=args.node_log_dir,
            node_gpus=tuple(g for g in (args.node_gpus or "").split(",") if g.strip()),
            node_drain_timeout_s=args.node_drain_timeout,
            node_watchdog_s=args.node_watchdog,
            compose=_compose(args) if args.actuator == "compose" else None,
            kubernetes=_kubernetes(args) if args.actuator == "kubernetes" else None,
        )


def _policy(args: argparse.Namespace, slo: SLOConfig) -> AutoscalerConfig:
    return AutoscalerConfig(
        prefill=PoolLimits(args.prefill_min, args.prefill_max, args.prefill_initial),
        decode=PoolLimits(args.decode_min, args.decode_max, args.decode_initial),
        ttft_slo_ms=slo.ttft_ms,
        itl_slo_ms=slo.itl_ms or slo.tpot_ms,
        queue_tokens_per_instance=args.queue_tokens_per_instance,
        prefill_capacity=args.prefill_capacity,
        decode_capacity=args.decode_capacity,
        up_cooldown_s=args.scale_up_cooldown,
        down_cooldown_s=args.scale_down_cooldown,
        down_delay_s=args.scale_down_delay,
        startup_grace_s=args.startup_grace,
        prefill_gpus=args.prefill_tp,
        decode_gpus=args.decode_tp,
        gpu_budget=args.gpu_budget if args.gpu_budget is not None else _count_gpus(args),
    )


def _count_gpus(args: argparse.Namespace) -> int | None:
    """The local actuator's ``--node-gpus`` are the budget when no other is given."""
    gpus = [g for g in (args.node_gpus or "").split(",") if g.strip()]
    return len(gpus) if gpus and args.actuator == "local" else None


def _compose(args: argparse.Namespace) -> ComposeTarget:
    from launcher.actuators import ComposeTarget

    return ComposeTarget(
        args.compose_file,
        args.compose_project,
        args.compose_prefill_service,
        args.compose_decode_service,
    )


def _kubernetes(args: argparse.Namespace) -> KubernetesTarget:
    from launcher.actuators import KubernetesTarget

    defaults = KubernetesTarget()
    return KubernetesTarget(
        api_url=args.k8s_api_url or defaults.api_url,
        namespace=args.k8s_namespace,
        prefill_deployment=args.k8s_prefill_deployment,
        decode_deployment=args.k8s_decode_deployment,
        token_file=Path(args.k8s_token_file) if args.k8s_token_file else defaults.token_file,
        ca_file=Path(args.k8s_ca_file) if args.k8s_ca_file else None,
    )


def build_actuator(
    settings: AutoscaleSettings,
    router_grpc: str,
    model: str,
    node_key: str | None = None,
    node_tls: NodeTLS | None = None,
) -> Actuator:
    """The configured actuator; local nodes register with ``router_grpc`` (presenting
    ``node_key``, passed in their environment) and serve ``model``; its watchdog reaches them
    as the router does (``node_tls``)."""
    from launcher import actuators
    from launcher.watchdog import WatchdogConfig

    if settings.actuator == "compose":
        return actuators.ComposeActuator(settings.compose or actuators.ComposeTarget())
    if settings.actuator == "kubernetes":
        return actuators.KubernetesActuator(settings.kubernetes or actuators.KubernetesTarget())
    assert settings.node_kv_store is not None  # checked in __post_init__
    log_dir = Path(settings.node_log_dir or tempfile.mkdtemp(prefix="pdserve-nodes-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    launch = actuators.NodeLaunch(
        router=router_grpc,
        kv_store=settings.node_kv_store,
        log_dir=log_dir,
        model=settings.node_model or model,
        extra_args=settings.node_args,
        gpus=settings.node_gpus,
        drain_timeout_s=settings.node_drain_timeout_s,
        prefill_tp=settings.policy.prefill_gpus,
        decode_tp=settings.policy.decode_gpus,
        env={**os.environ, "PDSERVE_NODE_KEY": node_key} if node_key else None,
    )
    watchdog = WatchdogConfig(settings.node_watchdog_s, tls=node_tls)
    return actuators.LocalProcessActuator(launch, watchdog=watchdog)


def add_autoscale_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--autoscale`` group to the router's parser (with PDSERVE_* overrides)."""
    d = AutoscalerConfig()
    group = parser.add_argument_group("autoscaling (with --autoscale)")
    actions: list[argparse.Action] = []

    def a(*flags: str, **kwargs: Any) -> None:
        actions.append(group.add_argument(*flags, **kwargs))

    a("--autoscale", action="store_true", help="size the prefill/decode pools from live load")
    a("--actuator", choices=ACTUATORS, default="local", help="who starts/stops instances")
    for pool, limits in (("prefill", d.prefill), ("decode", d.decode)):
        a(f"--{pool}-min", type=int, default=limits.minimum, help=f"fewest {pool} instances")
        a(f"--{pool}-max", type=int, default=limits.maximum, help=f"most {pool} instances")
        a(f"--{pool}-initial", type=int, default=None, help="start with this many (default min)")
    a("--autoscale-interval", type=float, default=2.0, help="seconds between decisions")
    a("--scale-up-cooldown", type=float, default=d.up_cooldown_s, help="s after a change")
    a("--scale-down-cooldown", type=float, default=d.down_cooldown_s, help="s after a change")
    a("--scale-down-delay", type=float, default=d.down_delay_s, help="s underused before -1")
    a("--startup-grace", type=float, default=d.startup_grace_s,
      help="s to wait for started instances before growing again")  # fmt: skip
    a("--queue-tokens-per-instance", type=int, default=d.queue_tokens_per_instance,
      help="prefill backlog per instance while its capacity is unmeasured")  # fmt: skip
    a("--prefill-capacity", type=float, default=None, help="tokens/s one prefill instance does")
    a("--decode-capacity", type=float, default=None, help="tokens/s one decode instance does")
    a("--prefill-tp", type=int, default=1,
      help="tensor-parallel size of a prefill instance: the GPUs it takes")  # fmt: skip
    a("--decode-tp", type=int, default=1,
      help="tensor-parallel size of a decode instance: the GPUs it takes")  # fmt: skip
    a("--gpu-budget", type=int, default=None,
      help="GPUs the pools may take in all (default: the number of --node-gpus, else no cap)")  # fmt: skip
    a("--node-kv-store", default=None, help="local actuator: the nodes' --kv-store URL")
    a("--node-model", default=None, help="local actuator: the nodes' --model (default --model)")
    a("--node-args", default="", help='local actuator: extra node flags, e.g. "--device cpu"')
    a("--node-log-dir", default=None, help="local actuator: node logs (default: a temp dir)")
    a("--node-gpus", default="",
      help="local actuator: GPU ids, e.g. 0,1,2,3; each node gets its TP size of them")  # fmt: skip
    a("--node-drain-timeout", type=float, default=300.0, help="local: s a stopped node drains")
    a("--node-watchdog", type=float, default=30.0,
      help="local: kill and replace a node hung this long (engine stuck while it holds requests,"
           " or no answer), s; 0: off")  # fmt: skip
    a("--compose-file", default=None, help="compose actuator: -f FILE")
    a("--compose-project", default=None, help="compose actuator: -p NAME")
    a("--compose-prefill-service", default="prefill")
    a("--compose-decode-service", default="decode")
    a("--k8s-api-url", default=None, help="kubernetes actuator: API server (in-cluster default)")
    a("--k8s-namespace", default=None, help="default: the service account's namespace")
    a("--k8s-prefill-deployment", default="pdserve-prefill")
    a("--k8s-decode-deployment", default="pdserve-decode")
    a("--k8s-token-file", default=None, help="bearer token file (default: service account)")
    a("--k8s-ca-file", default=None, help="API server CA (default: service account ca.crt)")
    _env_defaults(parser, actions)


def _env_defaults(parser: argparse.ArgumentParser, actions: list[argparse.Action]) -> None:
    """``PDSERVE_SCALE_UP_COOLDOWN=5`` becomes the default of ``--scale-up-cooldown``."""
    env = env_overrides()
    for action in actions:
        name = action.option_strings[0].lstrip("-").replace("-", "_")
        if name not in env:
            continue
        text = env[name]
        # argparse converts a string default with the flag's type when the flag is absent.
        value = text.strip().lower() in _TRUE if action.nargs == 0 else text
        parser.set_defaults(**{action.dest: value})
