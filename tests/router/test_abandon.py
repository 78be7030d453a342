"""Clients that leave: every abandoned request is aborted upstream, however many leave at once.

Non-streaming requests get no disconnect notice from Starlette; the router watches for it and
cancels the flow (``router.http_api._until_disconnect``). Here 50 clients send a long
non-streaming request on real uvicorn and close their connections mid-decode: every decode
call is aborted and nothing stays in flight. (The same with real nodes and their load reports:
``test_abandon_e2e.py``.)
"""

from __future__ import annotations

import asyncio
import json
import time

from tests.router.inproc import running_router, serving_http

BODY = json.dumps({"prompt": [1, 400, 401], "max_tokens": 400, "ignore_eos": True}).encode()


async def open_and_abandon(url: str, count: int, body: bytes = BODY) -> list[asyncio.StreamWriter]:
    """Send ``count`` non-streaming completions on their own connections; the caller closes
    the returned writers to abandon them."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json"
            f"\r\ncontent-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    writers = []
    for _ in range(count):
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        await writer.drain()
        writers.append(writer)
    return writers


def test_fifty_abandoned_non_streaming_requests_are_aborted() -> None:
    async def go() -> None:
        async with running_router() as h, serving_http(h.router) as url:
            for script in h.scripts("decode"):
                script.delay_s = 0.05  # 400 tokens: 20 s if nobody stops it
            writers = await open_and_abandon(url, 50)
            deadline = time.monotonic() + 30
            while sum(len(s.seen) for s in h.scripts("decode")) < 50:
                assert time.monotonic() < deadline, "the requests never reached decode"
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # mid-decode
            for writer in writers:
                writer.close()
            deadline = time.monotonic() + 5
            while h.router.core.inflight:
                assert time.monotonic() < deadline, f"{h.router.core.inflight} still in flight"
                await asyncio.sleep(0.05)
            decode_ids = [rid for s in h.scripts("decode") for rid in s.seen]
            assert len(decode_ids) == 50
            while (aborted := {r for s in h.scripts("decode") for r in s.aborted}) != set(
                decode_ids
            ):  # the aborts are sent as the flows end: the last may still be on their way
                missing = set(decode_ids) - aborted
                assert time.monotonic() < deadline, f"{len(missing)} never aborted: {missing}"
                await asyncio.sleep(0.05)

    asyncio.run(go())
