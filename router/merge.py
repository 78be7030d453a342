"""Several async streams as one: items in the order they arrive, the first error raised.

Used where one answer is made of several runs: a request's ``n`` samples (``router.flow``) and a
batched completion's prompts (``router.http_api``). Closing the merged stream (the client left,
or an error) cancels every run, which aborts their upstream calls.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TypeVar

T = TypeVar("T")


async def merged(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncGenerator[T, None]:
    """Every item of ``streams``, interleaved as they come; each stream is closed after."""
    if len(streams) == 1:  # nothing to interleave: no tasks, no queue
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[T | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait(item)
            queue.put_nowait(None)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        remaining = len(tasks)
        while remaining:
            got = await queue.get()
            if isinstance(got, BaseException):
                raise got
            if got is None:
                remaining -= 1
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
