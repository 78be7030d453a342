"""ITL as an HTTP client measures it, against the time each event was sent.

A server process streams ``--tokens`` server-sent events per request, one every ``--gap-ms``,
each carrying its send time (``perf_counter``: the monotonic clock, shared by processes on a
host). Two clients read ``--streams`` such requests at once:

- ``bench``: ``bench.http_stream`` (what ``pdserve bench`` uses): events stamped when read, on
  uvloop, JSON parsed after the stream;
- ``httpx pull``: ``httpx`` ``aiter_lines`` with one ``perf_counter()`` and one ``json.loads``
  per event, on asyncio (what ``pdserve bench`` did before).

For each: the median ITL it measures (the truth is the gap), the delivery lag (arrival stamp
minus send time: how far behind the wire the client reads) and its CPU time per event.

    python -m benchmarks.sse_client [--streams 32,64,128,192] [--tokens 100] [--gap-ms 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import numpy as np

from bench.http_stream import HttpStreamClient

# (arrival stamp, send time) of each token event of each request
Arrivals = list[list[tuple[float, float]]]

_SERVER = """
import asyncio, json, sys, time
TOKENS, GAP = int(sys.argv[2]), float(sys.argv[3]) / 1000
async def handle(reader, writer):
    while True:
        try:
            head = await reader.readuntil(b"\\r\\n\\r\\n")
        except asyncio.IncompleteReadError:  # the client closed its connection
            return
        length = int(next(line.split(b":")[1] for line in head.split(b"\\r\\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-type: text/event-stream\\r\\n"
                     b"transfer-encoding: chunked\\r\\n\\r\\n")
        for i in range(TOKENS):
            await asyncio.sleep(GAP)
            event = {"t": time.perf_counter(), "choices": [{"index": 0, "text": "x"}]}
            data = b"data: " + json.dumps(event).encode() + b"\\n\\n"
            writer.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
        done = b"data: [DONE]\\n\\n"
        writer.write(b"%x\\r\\n%s\\r\\n0\\r\\n\\r\\n" % (len(done), done))
        await writer.drain()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]))
    print("ready", flush=True)
    await server.serve_forever()
asyncio.run(main())
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _bench_client(url: str, streams: int) -> Arrivals:
    client = HttpStreamClient(url)

    async def one() -> list[tuple[float, float]]:
        response = await client.post("/v1/completions", b"{}", "application/json")
        events = [(at, data) for at, data in response.events if data != b"[DONE]"]
        return [(at, json.loads(data)["t"]) for at, data in events]

    try:
        return list(await asyncio.gather(*(one() for _ in range(streams))))
    finally:
        await client.aclose()


async def _httpx_pull(url: str, streams: int) -> Arrivals:
    async def one(client: httpx.AsyncClient) -> list[tuple[float, float]]:
        arrivals = []
        async with client.stream("POST", f"{url}/v1/completions", json={}) as response:
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if line.startswith("data:") and not line.endswith("[DONE]"):
                    arrivals.append((now, json.loads(line[5:])["t"]))
        return arrivals

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300.0, limits=limits, trust_env=False) as client:
        return list(await asyncio.gather(*(one(client) for _ in range(streams))))


def _measure(run: Callable[[], Arrivals]) -> dict[str, float]:
    before = resource.getrusage(resource.RUSAGE_SELF)
    arrivals = run()
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    itl = np.concatenate([np.diff([at for at, _ in stream]) for stream in arrivals]) * 1e3
    lag = np.array([at - sent for stream in arrivals for at, sent in stream]) * 1e3
    events = sum(len(stream) for stream in arrivals)
    return {
        "events": events,
        "itl_median_ms": float(np.median(itl)),
        "lag_median_ms": float(np.median(lag)),
        "lag_p90_ms": float(np.percentile(lag, 90)),
        "cpu_us_per_event": cpu_s / events * 1e6,
    }


def run(streams: list[int], tokens: int, gap_ms: float) -> list[dict[str, object]]:
    """One row per (client, stream count); the server runs in its own process."""
    import uvloop

    port = _free_port()
    argv = [sys.executable, "-c", _SERVER, str(port), str(tokens), str(gap_ms)]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"
    url = f"http://127.0.0.1:{port}"
    clients: dict[str, Callable[[int], Arrivals]] = {
        "bench": lambda n: uvloop.run(_bench_client(url, n)),
        "httpx pull": lambda n: asyncio.run(_httpx_pull(url, n)),
    }
    rows: list[dict[str, object]] = []
    try:
        for n in streams:
            for name, client in clients.items():
                figures = _measure(lambda client=client, n=n: client(n))
                rows.append({"client": name, "streams": n, **figures})
    finally:
        server.terminate()
        server.wait()
    return rows


def _table(rows: list[dict[str, object]], gap_ms: float) -> str:
    lines = [
        f"| client | streams | median ITL (ms; sent {gap_ms:g} apart) | delivery lag p50 / p90 "
        "(ms) | CPU per event (µs) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['client']} | {r['streams']} | {r['itl_median_ms']:.3f} | "
            f"{r['lag_median_ms']:.1f} / {r['lag_p90_ms']:.1f} | {r['cpu_us_per_event']:.0f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="32,64,128,192")
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--gap-ms", type=float, default=5.0)
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    print(_table(run(streams, args.tokens, args.gap_ms), args.gap_ms))


if __name__ == "__main__":
    main()
