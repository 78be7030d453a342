"""The router's ports in ``pdserve up``: claimed before anything starts, a busy one said in one line.

NOTE (holding a port). `up` binds each router port itself first, with SO_REUSEADDR and without
listening on it, and holds it until the router reports ready:

- a busy port fails here, at once and by name (:class:`PortInUse`), not deep inside the router
  after its start-up, with a traceback;
- a free port picked here (``--port 0``, ``--demo``) is known before the router starts, so the
  nodes start at the same time as the router and dial its gRPC port;
- while held, nobody else takes it: ``bind(0)`` and ``connect()`` skip a bound port.

The router still binds it: Linux lets a socket bind an address whose holder also set
SO_REUSEADDR and is not listening, and both the router's HTTP socket and gRPC's listeners set
SO_REUSEADDR. (Neither sets SO_REUSEPORT, so two listeners never share a port.)
"""

from __future__ import annotations

import errno
import re
import socket
from typing import NamedTuple


class PortInUse(RuntimeError):
    """A port someone else holds; the message is the one line `up` prints."""


class PortSpec(NamedTuple):
    """A port to claim: what it is for and the flag that sets it (for the error line)."""

    what: str  # "router HTTP"
    flag: str  # "--port"
    port: int  # 0: any free port


class HeldPort:
    """A bound, non-listening socket holding ``port`` on ``host`` (see the module NOTE)."""

    def __init__(self, host: str, spec: PortSpec) -> None:
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host.strip("[]"), spec.port))
        except OSError as exc:
            self.sock.close()
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise PortInUse(busy_message(spec, host)) from None
            raise
        self.port: int = self.sock.getsockname()[1]

    def release(self) -> None:
        self.sock.close()


def busy_message(spec: PortSpec, host: str) -> str:
    """The one line for a port that cannot be had."""
    return (
        f"port {spec.port} ({spec.what}) on {host} is already in use: choose another with"
        f" {spec.flag} PORT, or {spec.flag} 0 for any free port"
    )


def hold_router_ports(host: str, http_port: int, grpc_port: int) -> tuple[HeldPort, HeldPort]:
    """Hold the router's HTTP and gRPC ports; PortInUse (its message: the line to print)."""
    http = HeldPort(host, PortSpec("router HTTP", "--port", http_port))
    try:
        grpc = HeldPort(host, PortSpec("router gRPC", "--grpc-port", grpc_port))
    except PortInUse:
        http.release()
        raise
    return http, grpc


# What a child that could not bind writes: the router's and the nodes' own line ("cannot listen
# on 127.0.0.1:50051 …"), grpc ("Failed to bind to address 127.0.0.1:50051") and Python
# ("[Errno 98] Address already in use", which names no port).
_BIND_FAILED = re.compile(
    r"(?:Failed to bind to address|cannot bind \w+ to|cannot listen on)\s+\[?[\w.:]*?\]?:(\d+)"
    r"|\[Errno 98\] Address already in use"
)


def bind_failure(log: str) -> int | None:
    """The port a child's log says it failed to bind (0 when it names none); None otherwise."""
    match = _BIND_FAILED.search(log)
    if match is None:
        return None
    return int(match.group(1)) if match.group(1) else 0
