"""router.merge.merged: interleaves streams, raises the first error, closing cancels them all."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from router.merge import merged


async def ticks(name: str, n: int, delay: float, log: list[str]) -> AsyncGenerator[str, None]:
    try:
        for i in range(n):
            await asyncio.sleep(delay)
            yield f"{name}{i}"
    finally:
        log.append(f"{name} closed")


def test_items_interleave_as_they_come_and_every_stream_is_closed() -> None:
    async def main() -> tuple[list[str], list[str]]:
        log: list[str] = []
        streams = [ticks("a", 3, 0.03, log), ticks("b", 2, 0.01, log)]
        return [item async for item in merged(streams)], log

    items, log = asyncio.run(main())
    assert sorted(items) == ["a0", "a1", "a2", "b0", "b1"]
    assert items.index("b1") < items.index("a1")  # the faster stream is not held back
    assert sorted(log) == ["a closed", "b closed"]


def test_the_first_error_is_raised_and_the_others_are_cancelled() -> None:
    async def failing() -> AsyncGenerator[str, None]:
        await asyncio.sleep(0.01)
        raise ValueError("upstream broke")
        yield "never"

    async def main() -> list[str]:
        log: list[str] = []
        with pytest.raises(ValueError, match="upstream broke"):
            async for _ in merged([ticks("slow", 100, 0.05, log), failing()]):
                pass
        return log

    assert asyncio.run(main()) == ["slow closed"]


def test_closing_early_closes_every_stream() -> None:
    async def main() -> list[str]:
        log: list[str] = []
        stream = merged([ticks("a", 100, 0.01, log), ticks("b", 100, 0.01, log)])
        async for _ in stream:
            break
        await stream.aclose()
        return log

    assert sorted(asyncio.run(main())) == ["a closed", "b closed"]


def test_one_stream_passes_through() -> None:
    async def main() -> list[str]:
        return [item async for item in merged([ticks("a", 2, 0, [])])]

    assert asyncio.run(main()) == ["a0", "a1"]
