"""The HTTP transport of ``pdserve bench``: a streamed POST whose server-sent events are stamped
with the time they reached the client.

NOTE on timing. An event's arrival time is when the event loop read the bytes that completed it:
``data_received`` of an ``asyncio.Protocol`` takes ``perf_counter()`` before it parses anything,
and the JSON of the events is parsed only after the stream has ended. The socket is read whenever
it is readable, never paused while a consumer catches up.

Why not httpx (which bench used before, and which measured a median HTTP ITL of 0.02 ms against
3.66 ms over gRPC on the same cluster): its reads are pulled by the consumer (anyio pauses the
transport between reads) and every event costs ~60-80 µs of Python (anyio, h11, line decoding,
JSON) before the next read is asked for. Under load, 100 streams at the default ``--rate inf``,
the client falls behind; the kernel buffers the events, a later read returns several at once,
and they were stamped microseconds apart, one parse apart. The router writes each event as its
token arrives (its writes, logged, are as far apart as gRPC's items). docs/BENCHMARKS.md has
the measurements.

One connection per request in flight, reused (HTTP/1.1 keep-alive) once its response is fully
read; ``http://`` and ``https://``; no proxy from the environment.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import h11

_DEFAULT_PORTS = {"http": 80, "https": 443}


class HttpStreamError(Exception):
    """A request that got no complete answer; ``kind`` names the failure for the report."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind


@dataclass
class StreamedResponse:
    """``events``: ``(arrival perf_counter s, data)`` of each event's ``data:`` field, in order;
    ``body``: the raw body when it is not an event stream (an error answer); ``end_s``: when
    ``data: [DONE]`` arrived, else the body's last byte."""

    status: int = 0
    events: list[tuple[float, bytes]] = field(default_factory=list)
    body: bytes = b""
    end_s: float = 0.0


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection running one request at a time."""

    def __init__(self) -> None:
        self.h11 = h11.Connection(h11.CLIENT)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._response = StreamedResponse()
        self._done: asyncio.Future[StreamedResponse] | None = None
        self._pending = b""  # bytes of an event not yet complete
        self._is_stream = False

    # -- the request side (called by the client) --------------------------------------------
    def start(self, request: bytes) -> asyncio.Future[StreamedResponse]:
        assert self.transport is not None and self._done is None
        self._response, self._pending, self._is_stream = StreamedResponse(), b"", False
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self._done

    def recycle(self) -> bool:
        """Ready the connection for another request if its last exchange ended cleanly (both
        sides DONE); False: it cannot be reused and should be closed."""
        states = (self.h11.our_state, self.h11.their_state)
        if self.closed or states != (h11.DONE, h11.DONE):
            return False
        self.h11.start_next_cycle()
        self._done = None
        return True

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ---------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()  # before any parsing: this is the arrival time
        try:
            self.h11.receive_data(data)
            self._drain_events(now)
        except h11.RemoteProtocolError as exc:
            self._fail(HttpStreamError("RemoteProtocolError", str(exc)))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._done is None or self._done.done():
            return
        try:  # a body delimited by the connection's end ends here
            self.h11.receive_data(b"")
            self._drain_events(time.perf_counter())
        except h11.RemoteProtocolError:
            pass
        detail = f"server closed the connection mid-response ({exc or 'EOF'})"
        self._fail(HttpStreamError("RemoteProtocolError", detail))

    # -- parsing ------------------------------------------------------------------------------
    def _drain_events(self, now: float) -> None:
        while self._done is not None and not self._done.done():
            event = self.h11.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
            if isinstance(event, h11.Response):
                self._response.status = event.status_code
                content_type = dict(event.headers).get(b"content-type", b"")
                self._is_stream = event.status_code == 200 and b"event-stream" in content_type
            elif isinstance(event, h11.Data):
                self._on_body(event.data, now)
            elif isinstance(event, h11.EndOfMessage):
                self._finish(now)
            elif isinstance(event, h11.ConnectionClosed):
                self._fail(HttpStreamError("RemoteProtocolError", "connection closed"))

    def _on_body(self, data: bytes, now: float) -> None:
        if not self._is_stream:
            self._response.body += data
            return
        buffer = (self._pending + data).replace(b"\r\n", b"\n")
        *complete, self._pending = buffer.split(b"\n\n")
        for block in complete:
            payload = _event_data(block)
            if payload is None:
                continue  # a comment or keep-alive: no data field
            self._response.events.append((now, payload))
            if payload == b"[DONE]":  # the OpenAI stream's last event; the body ends next
                self._response.end_s = now

    def _finish(self, now: float) -> None:
        """The body has ended: the connection can serve another request."""
        if self._done is not None and not self._done.done():
            self._response.end_s = self._response.end_s or now
            self._done.set_result(self._response)

    def _fail(self, error: HttpStreamError) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        self.close()


def _event_data(block: bytes) -> bytes | None:
    """The ``data`` field of one SSE event (its ``data:`` lines joined by newlines)."""
    lines = [line for line in block.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[6:] if line[5:6] == b" " else line[5:] for line in lines)


class HttpStreamClient:
    """POSTs to one server, returning each response with its events' arrival times.

    ``timeout_s`` bounds a whole request (connect included; connecting alone at most
    ``connect_timeout_s``). Failures raise :class:`HttpStreamError`.
    """

    def __init__(
        self,
        base_url: str,
        headers: Sequence[tuple[str, str]] = (),
        timeout_s: float = 600.0,
        connect_timeout_s: float = 30.0,
    ) -> None:
        url = urlsplit(base_url)
        if url.scheme not in _DEFAULT_PORTS or not url.hostname:
            raise ValueError(f"expected an http:// or https:// URL, got {base_url!r}")
        self.host = url.hostname
        self.port = url.port or _DEFAULT_PORTS[url.scheme]
        self.prefix = url.path.rstrip("/")
        self.ssl = ssl.create_default_context() if url.scheme == "https" else None
        self.headers = [("Host", url.netloc.rpartition("@")[2]), *headers]
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self._idle: list[_Connection] = []

    async def post(self, path: str, body: bytes, content_type: str) -> StreamedResponse:
        """POST ``body`` to ``prefix + path``; the response once read to its end."""
        try:
            return await asyncio.wait_for(self._post(path, body, content_type), self.timeout_s)
        except asyncio.TimeoutError:
            raise HttpStreamError(
                "Timeout", f"no complete answer in {self.timeout_s:g} s"
            ) from None

    async def _post(self, path: str, body: bytes, content_type: str) -> StreamedResponse:
        connection = await self._connection()
        headers = [
            *self.headers,
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
        ]
        request = h11.Request(method="POST", target=self.prefix + path, headers=headers)
        wire = connection.h11.send(request) or b""
        wire += (connection.h11.send(h11.Data(data=body)) or b"") + (
            connection.h11.send(h11.EndOfMessage()) or b""
        )
        try:
            response = await connection.start(wire)
        except BaseException:
            connection.close()  # a cancelled or failed request leaves no half-read connection
            raise
        if connection.recycle():
            self._idle.append(connection)
        else:
            connection.close()
        return response

    async def _connection(self) -> _Connection:
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed:
                return connection
        loop = asyncio.get_running_loop()
        server_hostname = self.host if self.ssl is not None else None
        opening = loop.create_connection(
            _Connection, self.host, self.port, ssl=self.ssl, server_hostname=server_hostname
        )
        try:
            _, connection = await asyncio.wait_for(opening, self.connect_timeout_s)
        except (OSError, asyncio.TimeoutError) as exc:
            detail = f"{self.host}:{self.port}: {exc or type(exc).__name__}"
            raise HttpStreamError("ConnectError", detail) from None
        return connection

    async def aclose(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
