"""API keys, request-size limits and TLS credentials.

- HTTP: :class:`GuardMiddleware` (pure ASGI, runs before routing) rejects oversized headers
  (431) and declared-oversized bodies (413), then requires ``Authorization: Bearer <key>`` on
  every path except ``/health`` and ``/ready`` (401). Bodies without a Content-Length are capped
  while read (``router.http_api.read_body``). uvicorn's own h11 limit stays above ours as a
  backstop. An oversized body is read and dropped (up to ``DRAIN_BYTES``) before the 413 goes
  out: a server that answers and closes with the body unread resets the connection, and the
  client, still writing, never sees the answer. JSON nesting is bounded before parsing
  (:func:`json_too_deep`): the parser recurses once per level.
- gRPC: ``Generate`` checks the ``authorization`` metadata with :func:`bearer_ok` against the
  API key; the node-facing methods (Register/Heartbeat/Deregister) against the node key
  (``--node-key``, else the API key). Mutual TLS is the option where the network is not
  trusted.
- TLS: :func:`server_credentials` (optional client CA: mutual TLS).

Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from itertools import accumulate, repeat
from pathlib import Path
from typing import Any

import grpc

from router.errors import RouterError, too_large, unauthorized

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

PUBLIC_PATHS = frozenset({"/health", "/ready"})
DRAIN_BYTES = 64 * 2**20  # an oversized body up to this is read (and dropped) before the 413
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NESTING = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # opener: +1, closer: -1 (after -1)


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
    max_json_depth: int = 64

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


def json_too_deep(raw: bytes, max_depth: int) -> bool:
    """True when the JSON text ``raw`` nests arrays and objects deeper than ``max_depth``.

    Linear and C-speed (no parsing): brackets inside strings are skipped; malformed text is
    measured the same way, since a recursive parser would descend as deep before failing."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(_NESTING, delete=_NOT_BRACKETS)
    return max(accumulate(map(int.__sub__, brackets, repeat(1))), default=0) > max_depth


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[{]}")


class GuardMiddleware:
    """ASGI middleware applying an :class:`HttpGuard` to every HTTP request."""

    def __init__(self, app: ASGIApp, guard: HttpGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self.guard.check(scope)
            if error is not None:
                if error.status == 413 and not _expects_continue(scope):
                    await drain(receive)  # a 100-continue client has not sent it: no need
                await send_error(send, error)
                return
        await self.app(scope, receive, send)


def _expects_continue(scope: Scope) -> bool:
    expect = _header(scope.get("headers", []), b"expect")
    return expect is not None and expect.lower() == "100-continue"


async def drain(receive: Receive, limit: int = DRAIN_BYTES) -> None:
    """Read and drop the rest of a request body (at most ``limit`` bytes), so that the
    answer that follows reaches a client that is still sending."""
    size = 0
    while size <= limit:
        message = await receive()
        if message["type"] != "http.request":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


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
