"""``pdserve health``: one probe for container healthchecks, exit status 0 when healthy.

    pdserve health --grpc 127.0.0.1:50061      # a node: grpc.health.v1 Check says SERVING
    pdserve health --grpc 127.0.0.1:50061 --tls-ca ca.pem --tls-server-name NAME   # a TLS node
    pdserve health --http http://127.0.0.1:8000/health [--ready]   # the router: HTTP 200
                                                                   # (--ready: and a full pool)

Status 1 means unhealthy or unreachable (the reason goes to stderr). Container healthchecks run
it as ``python -m launcher.health_check ...`` (same flags): that imports only grpc or httpx, not
the whole CLI (which loads torch), so it is cheap enough to run every few seconds.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.node_clients import NodeTLS


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    """Add the ``health`` subcommand."""
    parser = subparsers.add_parser("health", help="probe a node (gRPC) or the router (HTTP)")
    add_arguments(parser)
    parser.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="grpc.health.v1 Check of a node")
    target.add_argument("--http", metavar="URL", help="GET URL, e.g. the router's /health")
    parser.add_argument("--ready", action="store_true",
                        help="--http: also require {'ready': true} (both pools have instances)")  # fmt: skip
    parser.add_argument("--service", default="", help="--grpc: health service name")
    parser.add_argument("--tls-ca", help="--grpc: the node serves TLS; verify it with this CA")
    parser.add_argument("--tls-server-name",
                        help="--grpc: the name its certificate carries (default: the address)")  # fmt: skip
    parser.add_argument("--tls-cert", help="--grpc: client certificate (a mutual-TLS node)")
    parser.add_argument("--tls-key", help="--grpc: its private key")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")


def main(args: argparse.Namespace) -> int:
    try:
        if args.grpc:
            ok, detail = check_grpc(args.grpc, args.service, args.timeout, tls_of(args))
        else:
            ok, detail = check_http(args.http, args.ready, args.timeout)
    except Exception as exc:  # any failure to ask is "unhealthy", never a traceback
        ok, detail = False, f"{type(exc).__name__}: {exc}"
    print(detail, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def tls_of(args: argparse.Namespace) -> NodeTLS | None:
    """How to reach a node that serves TLS (the router's own `NodeTLS`), or None."""
    from router.node_clients import NodeTLS  # grpc and the protos only: cheap

    return NodeTLS.from_flags(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def check_grpc(
    address: str, service: str, timeout_s: float, tls: NodeTLS | None = None
) -> tuple[bool, str]:
    """(SERVING?, status name) of the standard gRPC health service at ``address``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if tls is None:
        channel = grpc.insecure_channel(address)
    else:
        channel = grpc.secure_channel(address, tls.credentials(), options=tls.options())
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"  # type: ignore[attr-defined]
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, name


def check_http(url: str, require_ready: bool, timeout_s: float) -> tuple[bool, str]:
    """(200 [and ready]?, body) of GET ``url``."""
    import httpx

    response = httpx.get(url, timeout=timeout_s)
    ok = response.status_code == 200
    if ok and require_ready:
        ok = bool(response.json().get("ready"))
    return ok, f"{response.status_code} {response.text.strip()[:200]}"


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m launcher.health_check`` (the flags of ``pdserve health``)."""
    parser = argparse.ArgumentParser(prog="python -m launcher.health_check", description=__doc__)
    add_arguments(parser)
    return parser


if __name__ == "__main__":
    sys.exit(main(build_parser().parse_args()))
