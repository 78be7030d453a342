"""How long the router waits on a node's call: a decode stream's per-token deadline, and giving
up at once on a node the registry has lost (stalled or silent: ``Instance.lose``).

NOTE (the per-token deadline). A decode stream that delivers no item for ``deadline_s`` (the
router's ``--progress-timeout``) is given up — the flow resumes the request on another decode
node from the tokens already sent — unless its node is known live and full (``may_wait``: its
engine loop turns, its report is fresh, every seat or nearly all its KV cache is taken), where a
request may just be queued; such a wait is still cut at ``cap_s`` (``--decode-stall-timeout``).
A node the registry marks stalled (its engine loop stood still while it held requests) or drops
(no heartbeat) is lost: every call waiting on it gives up at once, between two items.

Items are read by one task per stream into a queue, so the wait for the next item can end
(deadline, node lost) without cancelling the call, which a cancelled ``call.read()`` would.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from pdserve_proto import pdserve_pb2 as pb

from router.registry import Instance

T = TypeVar("T")

_Item = pb.DecodeResponse | BaseException | None  # None: the stream ended


class NodeLost(Exception):
    """The call's node stalled or went silent, or its stream gave no token in time: the request
    moves to another node."""


class DecodeItems:
    """The items of one Decode call on ``instance`` (see the module NOTE). :meth:`close` when
    done: it stops the reader (cancelling the call if it still runs)."""

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[pb.DecodeRequest, pb.DecodeResponse],
        instance: Instance,
        may_wait: Callable[[], bool],
        deadline_s: float,
        cap_s: float,
    ) -> None:
        self._instance = instance
        self._may_wait = may_wait
        self._deadline_s = deadline_s
        self._cap_s = cap_s
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read(call))
        instance.on_lost.add(self._lost)
        if instance.lost:
            self._lost()

    async def _read(self, call: grpc.aio.UnaryStreamCall[pb.DecodeRequest, pb.DecodeResponse]):
        try:
            while (item := await call.read()) is not grpc.aio.EOF:
                self._queue.put_nowait(item)
            self._queue.put_nowait(None)
        except grpc.aio.AioRpcError as exc:
            self._queue.put_nowait(exc)

    def _lost(self) -> None:
        why = f"{self._instance.address} stalled or went silent"
        self._queue.put_nowait(NodeLost(why))

    async def next(self) -> pb.DecodeResponse | None:
        """The next item; None at the stream's end. Raises the call's AioRpcError, or NodeLost
        (node lost, or no item in time).

        ``asyncio.timeout``, not ``wait_for``: on Python 3.11 ``wait_for`` swallows a
        cancellation that lands as the item arrives, and the flow of a client that left would
        run on to ``max_tokens`` (seen with tens of requests abandoned at once)."""
        waited = 0.0
        while True:
            wait_s = min(self._deadline_s, self._cap_s - waited)
            try:
                async with asyncio.timeout(wait_s):
                    item = await self._queue.get()
            except TimeoutError:
                waited += wait_s
                if waited >= self._cap_s or not self._may_wait():
                    raise NodeLost(f"no token for {waited:g} s") from None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def close(self) -> None:
        self._instance.on_lost.discard(self._lost)
        self._reader.cancel()


async def until_lost(instance: Instance, call: Awaitable[T]) -> T:
    """``await call``, unless ``instance`` is lost first: then the call is cancelled and
    NodeLost raised. Cancelling the waiter cancels the call."""
    task = asyncio.ensure_future(call)
    lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_lost() -> None:
        if not lost.done():
            lost.set_result(None)

    instance.on_lost.add(on_lost)
    if instance.lost:
        on_lost()
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        instance.on_lost.discard(on_lost)
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise NodeLost(f"{instance.address} stalled or went silent")
