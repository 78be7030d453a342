"""An idle HTTP keep-alive connection outlives clients' pool expiry (httpx/openai: 5 s).

Were the router to close it at 5 s too, a client reusing it at that moment gets "connection
reset" for a request the router never saw (it happened to the live autoscaling test).
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

from tests.router.conftest import Cluster

REQUEST = b"GET /health HTTP/1.1\r\nHost: router\r\nConnection: keep-alive\r\n\r\n"


def _exchange(conn: socket.socket) -> bytes:
    conn.sendall(REQUEST)
    reply = b""
    while b"\r\n\r\n" not in reply:
        chunk = conn.recv(65536)
        assert chunk, "the router closed the connection"
        reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += conn.recv(65536)
    return head.split(b"\r\n", 1)[0]


def test_idle_connection_is_kept_past_client_pool_expiry(cluster: Cluster) -> None:
    url = urlsplit(cluster.router.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as conn:
        assert _exchange(conn) == b"HTTP/1.1 200 OK"
        time.sleep(6.0)  # past httpx's 5 s keepalive expiry (uvicorn's own default is 5 s)
        assert _exchange(conn) == b"HTTP/1.1 200 OK"
