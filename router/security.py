"""API keys, request-size limits and TLS credentials.

- HTTP: :class:`GuardMiddleware` (pure ASGI, runs before routing) rejects oversized headers
  (431) and declared-oversized bodies (413), then requires ``Authorization: Bearer <key>`` on
  every path except ``/health`` (401). Bodies without a Content-Length are capped while read
  (``router.http_api.read_body``). uvicorn's own h11 limit stays above ours as a backstop.
- gRPC: ``Generate`` checks the ``authorization`` metadata with :func:`bearer_ok`; node-facing
  methods (Register/Heartbeat/Deregister) rely on mutual TLS where the network is not trusted.
- TLS: :func:`server_credentials` (optional client CA: mutual TLS).

Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from router.errors import RouterError, too_large, unauthorized

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health"})


def bearer_ok(authorization: str | None, api_key: str | None) -> bool:
    """True when no key is configured, or ``authorization`` is ``Bearer <api_key>``."""
    if api_key is None:
        return True
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), api_key.encode())


@dataclass(frozen=True)
class HttpGuard:
    """What the HTTP front door enforces before a request reaches a route."""

    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 16 * 2**10

    def check(self, scope: Scope) -> RouterError | None:
        """The error to answer with, or None to let the request through."""
        headers: list[tuple[bytes, bytes]] = scope.get("headers", [])
        if sum(len(k) + len(v) for k, v in headers) > self.max_header_bytes:
            return too_large(f"request headers exceed {self.max_header_bytes} bytes", 431)
        length = _header(headers, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return too_large(f"request body exceeds {self.max_body_bytes} bytes")
        if scope.get("path") not in PUBLIC_PATHS and not bearer_ok(
            _header(headers, b"authorization"), self.api_key
        ):
            return unauthorized()
        return None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None


class GuardMiddleware:
    """ASGI middleware applying an :class:`HttpGuard` to every HTTP request."""

    def __init__(self, app: ASGIApp, guard: HttpGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.guard.check(scope)
            if error is not None:
                await send_error(send, error)
                return
        await self.app(scope, receive, send)


async def send_error(send: Send, error: RouterError) -> None:
    """Answer with ``error``'s status and OpenAI error body, straight over ASGI."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if error.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """TLS for the router's gRPC port; with ``client_ca_file`` clients must present a cert."""
    pair = (Path(key_file).read_bytes(), Path(cert_file).read_bytes())
    client_ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
