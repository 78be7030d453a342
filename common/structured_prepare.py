"""Structured outputs made ready off the engine loop.

Importing xgrammar (it loads torch's FFI runtime) and building the tokenizer's grammar data
take seconds (17-23 s measured for a node's first constrained request, every stream of the node
frozen meanwhile). ``PreparedStructuredOutputs`` does that on a worker thread: at start-up when
the engine is told it will serve grammars (nodes), else at the first constrained request. A
constrained request that arrives before it is ready waits, flagged ``waiting_for_grammar``
like one whose grammar is compiling, while the engine keeps stepping the others; once ready,
the waiting requests go to the real ``StructuredOutputs`` in arrival order.

This module imports neither xgrammar nor torch: the engine holds it from the start for free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.request import Request
    from common.step_outputs import EngineCoreOutput, SchedulerOutput
    from common.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)


class PreparedStructuredOutputs:
    """``StructuredOutputs``' interface, built by ``build`` on a worker thread."""

    def __init__(self, build: Callable[[], StructuredOutputs]) -> None:
        self._build = build
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future[StructuredOutputs] | None = None
        self._ready: StructuredOutputs | None = None
        self._failed: str | None = None  # why it could not be built
        self._waiting: dict[str, Request] = {}  # arrived before it was ready

    def start(self) -> None:
        """Begin building (idempotent); returns at once."""
        if self._future is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-prepare")
            self._future = self._executor.submit(self._build)

    def wait(self, timeout_s: float | None = None) -> StructuredOutputs | None:
        """Start building if needed and wait up to ``timeout_s`` for it (tests, tools; the
        engine never waits): the built object, or None (not yet, or it failed)."""
        self.start()
        assert self._future is not None
        try:
            self._future.exception(timeout=timeout_s)
        except TimeoutError:
            return None
        return self._take_ready()

    def add(self, request: Request) -> None:
        ready = self._take_ready()
        if ready is not None:
            ready.add(request)
            return
        request.waiting_for_grammar = True  # the scheduler passes it over until ready
        self._waiting[request.request_id] = request
        self.start()

    def poll(self) -> list[tuple[str, str]]:
        """As ``StructuredOutputs.poll``; the requests that waited for the build first go in
        (or are refused with the reason it failed)."""
        ready = self._take_ready()
        if ready is None:
            if self._failed is None:
                return []
            refused = [(rid, self._failed) for rid in self._waiting]
            self._waiting.clear()
            return refused
        for request in self._waiting.values():
            ready.add(request)
        self._waiting.clear()
        return ready.poll()

    def _take_ready(self) -> StructuredOutputs | None:
        if self._ready is None and self._future is not None and self._future.done():
            error = self._future.exception()
            if error is None:
                self._ready = self._future.result()
            elif self._failed is None:
                logger.error("structured outputs unavailable: %s", error)
                self._failed = f"structured outputs are unavailable on this engine: {error}"
        return self._ready

    @property
    def num_pending(self) -> int:
        ready = self._ready.num_pending if self._ready is not None else 0
        return ready + len(self._waiting)

    def bitmask(self, out: SchedulerOutput) -> Any:
        return self._ready.bitmask(out) if self._ready is not None else None

    def accept(self, outputs: Iterable[EngineCoreOutput]) -> None:
        if self._ready is not None:
            self._ready.accept(outputs)

    def drop(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for request_id in ids:
            self._waiting.pop(request_id, None)
        if self._ready is not None:
            self._ready.drop(ids)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
        if self._take_ready() is not None:
            self._ready.close()  # type: ignore[union-attr]
