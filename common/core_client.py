"""Asyncio client of an engine-core process: what a node's gRPC frontend talks to.

NOTE: one reader task owns the output socket and routes every message: ``Outputs`` go to the
per-request ``asyncio.Queue`` of their request, ``LoadStats`` resolve the future of the query that
asked, ``Fatal`` (or the process dying) fails everything. Requests are sent on the input socket
directly (a PUSH send never blocks: the high-water mark is off). A request's stream is an
:class:`OutputStream`; closing it early — ``aclose()``, leaving ``async with``, or cancelling the
task that awaits it — aborts the request in the core, so its blocks are freed. A request with
``n`` samples is sent as ``n`` engine requests (``common/parallel_sampling.py``), whose outputs
come back through the one stream, each tagged with its sample's index.

```
 CoreClient ──PUSH ipc://…/input──▶ engine core (common.core_process)
     ▲ reader task ◀──PULL ipc://…/output──┘
     └──▶ requests[request_id of the sample].queue ──▶ OutputStream ──▶ gRPC handler
```
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, cast

import zmq
import zmq.asyncio

from common.config import EngineConfig
from common.core_messages import (
    AbortRequests,
    AddRequest,
    Fatal,
    GetLoad,
    LoadStats,
    Message,
    Outputs,
    Ready,
    RequestError,
    RequestTiming,
    Shutdown,
    decode,
    encode,
    engine_config_to_dict,
)
from common.kv_interface import KVHandle
from common.lora.adapter import LoraRef
from common.parallel_sampling import Sample, split_samples
from common.sampling_params import SamplingParams
from common.step_outputs import EngineCoreOutput

if TYPE_CHECKING:
    from common.kv_connector import ConnectorFactory

logger = logging.getLogger(__name__)

_WATCH_MS = 500  # how often the reader checks that the core is alive while no message comes


def _engine_core_main(*args: object) -> None:
    """Spawn target: imports the engine (torch) in the child only, keeping the frontend light."""
    from common.core_process import run_engine_core

    run_engine_core(*args)  # type: ignore[arg-type]


class CoreRequestError(Exception):
    """The core refused or lost a request. ``code``: ``invalid_argument``,
    ``resource_exhausted``, ``already_exists`` or ``unavailable`` (the core is gone)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class CoreOutput:
    """One output of sample ``index`` of a request; ``timing`` is set on the sample's first
    output only."""

    output: EngineCoreOutput
    timing: RequestTiming | None
    index: int = 0

    @property
    def finished(self) -> bool:
        """The sample's last output."""
        return self.output.finish_reason is not None


_Item = CoreOutput | CoreRequestError


@dataclass
class _Request:
    """A request the client waits on: its stream's queue and its samples still running (engine
    request id → sample index)."""

    queue: asyncio.Queue[_Item]
    samples: dict[str, int] = field(default_factory=dict)


class OutputStream:
    """Async iterator over one request's outputs, ending once every sample has given the one
    with a finish reason.

    Raises :class:`CoreRequestError` if the core refused the request (before any output) or died.
    Closing it before the end — or a refused sample — aborts the request in the core.
    """

    def __init__(
        self, client: CoreClient, request_id: str, queue: asyncio.Queue[_Item], num_samples: int
    ) -> None:
        self._client, self.request_id, self._queue = client, request_id, queue
        self._unfinished = num_samples
        self._done = False
        self._held: _Item | None = None  # taken from the queue by ready(), not yet returned

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> CoreOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = self._take() or await self._queue.get()
        except asyncio.CancelledError:
            self._close()
            raise
        return self._accept(item)

    def ready(self) -> list[CoreOutput]:
        """Outputs already queued, without waiting (up to the final one). Lets a consumer that
        fell behind send several steps' tokens at once; an error stays for ``__anext__``."""
        items: list[CoreOutput] = []
        while not self._done and self._held is None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, CoreRequestError):
                self._held = item
            else:
                items.append(self._accept(item))
        return items

    def _take(self) -> _Item | None:
        item, self._held = self._held, None
        return item

    def _accept(self, item: _Item) -> CoreOutput:
        if isinstance(item, CoreRequestError):
            self._close()  # the request's other samples, if any, are aborted
            raise item
        if item.finished:
            self._unfinished -= 1
        self._done = self._unfinished == 0
        return item

    def _close(self) -> None:
        if not self._done:
            self._done = True
            self._client._cancel(self.request_id, self._queue)

    async def aclose(self) -> None:
        self._close()

    async def __aenter__(self) -> OutputStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close()


def _kill_at_exit(process: multiprocessing.process.BaseProcess) -> None:
    """Before multiprocessing joins its non-daemonic children at exit: no wait for a core."""
    if process.is_alive():
        process.kill()
        process.join(5.0)


class CoreClient:
    """Starts an engine-core process and talks to it. Use from one event loop only."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        connector_factory: ConnectorFactory | None = None,
        startup_timeout_s: float = 600.0,
    ) -> None:
        """``connector_factory``: handed to the engine in its process (picklable: a module-level
        function such as ``kv_transfer.connector.create_store_connector``)."""
        self.config = config
        self.connector_factory = connector_factory
        self.startup_timeout_s = startup_timeout_s
        self.info: Ready | None = None
        self._requests: dict[str, _Request] = {}
        self._request_of: dict[str, str] = {}  # engine request id (a sample) → request id
        self._load_waiters: dict[int, asyncio.Future[LoadStats]] = {}
        # the newest load the core sent, answering any query (a late answer still counts)
        self.last_load: LoadStats | None = None
        self._query_ids = itertools.count()
        self._dead: str | None = None  # why the core is unusable, once it is
        self._failed = asyncio.Event()  # set when the core died or failed (not on shutdown)
        self._ready: asyncio.Future[Ready] | None = None
        self._reader: asyncio.Task[None] | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._dir = Path(tempfile.mkdtemp(prefix="pdserve-core-"))  # mode 0700
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._input = self._bind(self._sync_ctx, zmq.PUSH, "input")
        self._output = cast(zmq.asyncio.Socket, self._bind(self._async_ctx, zmq.PULL, "output"))

    def _bind(self, context: zmq.Context, kind: int, name: str) -> zmq.Socket:
        sock = context.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self._dir / name}")
        return sock

    # -- life cycle --------------------------------------------------------------------------
    async def start(self) -> Ready:
        """Spawn the core and wait for its ``Ready``. Raises RuntimeError if it dies or times
        out first (the child is killed then)."""
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(
            target=_engine_core_main,
            args=(
                engine_config_to_dict(self.config),
                f"ipc://{self._dir / 'input'}",
                f"ipc://{self._dir / 'output'}",
                logging.getLogger().getEffectiveLevel(),
                self.connector_factory,
            ),
            name="pdserve-engine-core",
            # multiprocessing ends a daemonic child at exit, but forbids it children: a core
            # with tensor-parallel ranks is not one; it is killed at exit below, its ranks die
            # with it (``common/parent_death.py``)
            daemon=self.config.tensor_parallel_size == 1,
        )
        self._process.start()
        if not self._process.daemon:
            atexit.register(_kill_at_exit, self._process)
        self._ready = asyncio.get_running_loop().create_future()
        self._reader = asyncio.create_task(self._read_loop(), name="core-reader")
        try:
            self.info = await asyncio.wait_for(self._ready, self.startup_timeout_s)
        except (asyncio.TimeoutError, RuntimeError) as e:
            await self.shutdown(timeout_s=1.0)
            if isinstance(e, asyncio.TimeoutError):
                raise RuntimeError(
                    f"engine core not ready after {self.startup_timeout_s:.0f} s"
                ) from None
            raise
        return self.info

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort everything, stop the core (killing it after ``timeout_s``), free the sockets.
        Idempotent; leaves no process behind."""
        process, self._process = self._process, None
        if process is not None and process.is_alive():
            if self.info is None:  # still starting: it reads no message before it is ready
                process.terminate()  # (Ctrl-C of `up` waited 30 s for a node's starting core)
                await asyncio.to_thread(process.join, 5.0)
            else:
                self._send(Shutdown())
                await asyncio.to_thread(process.join, timeout_s)
            if process.is_alive():
                logger.warning("engine core did not stop in %.0f s: killing it", timeout_s)
                process.kill()
                await asyncio.to_thread(process.join, 5.0)
        self._fail_all("unavailable", "engine core shut down")
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._input.closed:
            return
        self._input.close(linger=0)
        self._output.close(linger=0)
        self._sync_ctx.term()
        self._async_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def wait_failed(self) -> str:
        """Return, with the reason, once the core has died or failed (never after a plain
        :meth:`shutdown`)."""
        await self._failed.wait()
        return self._dead or "engine core failed"

    @property
    def alive(self) -> bool:
        return self._dead is None and self.info is not None

    @property
    def num_requests(self) -> int:
        """Requests this client is waiting on (added, not finished)."""
        return len(self._requests)

    # -- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        output_token_ids: list[int] | None = None,
        kv_handle: KVHandle | None = None,
        lora: LoraRef | None = None,
    ) -> OutputStream:
        """Send the request now — ``params.n`` engine requests, one per sample — and return the
        stream of their outputs. A refusal (bad input, queue full, id in use, a handle that is
        not this prompt's, core gone) is raised by the stream's first ``__anext__``.
        """
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        stream = OutputStream(self, request_id, queue, params.n)
        try:
            samples = self._split(request_id, params, output_token_ids)
        except CoreRequestError as refusal:
            queue.put_nowait(refusal)
            return stream
        request = self._requests[request_id] = _Request(queue)
        outputs = output_token_ids or []
        for sample in samples:
            request.samples[sample.request_id] = sample.index
            self._request_of[sample.request_id] = request_id
            message = AddRequest(
                sample.request_id, prompt_token_ids, sample.params, priority, outputs, kv_handle,
                lora,
            )  # fmt: skip
            if not self._send(message):
                self._cancel(request_id, queue)
                queue.put_nowait(CoreRequestError("unavailable", "engine core is not connected"))
                break
        return stream

    def _split(
        self, request_id: str, params: SamplingParams, output_token_ids: list[int] | None
    ) -> list[Sample]:
        """The request's samples, or the reason (a CoreRequestError) it is refused here."""
        if self._dead is not None:
            raise CoreRequestError("unavailable", self._dead)
        if output_token_ids and params.n > 1:
            raise CoreRequestError("invalid_argument", "resuming (output_token_ids) needs n == 1")
        try:
            samples = split_samples(request_id, params, self.config.scheduler.max_n)
        except ValueError as e:
            raise CoreRequestError("invalid_argument", str(e)) from None
        in_use = [s.request_id for s in samples if s.request_id in self._request_of]
        if request_id in self._requests or in_use:
            raise CoreRequestError("already_exists", f"request id {request_id!r} is in use")
        return samples

    def abort(self, request_id: str) -> bool:
        """Abort a request (every sample); its stream ends with an ``abort`` output per sample.
        False if unknown here."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._send(AbortRequests(list(request.samples)))
        return True

    def _cancel(self, request_id: str, queue: asyncio.Queue[_Item]) -> None:
        """The consumer of ``queue`` went away: forget the request and abort what is left of it
        in the core."""
        request = self._requests.get(request_id)
        if request is None or request.queue is not queue:
            return
        del self._requests[request_id]
        for sample_id in request.samples:
            del self._request_of[sample_id]
        if self._dead is None and request.samples:
            self._send(AbortRequests(list(request.samples)))

    def _end_sample(self, sample_id: str) -> _Request:
        """A sample ended (finished or refused): stop routing it; the request ends with its
        last sample."""
        request_id = self._request_of.pop(sample_id)
        request = self._requests[request_id]
        del request.samples[sample_id]
        if not request.samples:
            del self._requests[request_id]
        return request

    async def get_load(self, timeout_s: float = 30.0) -> LoadStats:
        """The core's load, answered between two steps. Raises RuntimeError if it is gone."""
        if self._dead is not None:
            raise RuntimeError(self._dead)
        query_id = next(self._query_ids)
        future: asyncio.Future[LoadStats] = asyncio.get_running_loop().create_future()
        self._load_waiters[query_id] = future
        self._send(GetLoad(query_id))
        try:
            return await asyncio.wait_for(future, timeout_s)
        finally:
            self._load_waiters.pop(query_id, None)

    def _send(self, message: Message) -> bool:
        """Queue ``message`` for the core without ever blocking the event loop.

        A PUSH socket with no connected peer would block forever (a core that died before or
        while connecting); that is reported as False instead."""
        try:
            self._input.send(encode(message), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    # -- the reader --------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            if not await self._output.poll(_WATCH_MS):
                if self._process is not None and not self._process.is_alive():
                    code = self._process.exitcode
                    self._set_dead(f"engine core process exited (code {code})")
                    return
                continue
            data = await self._output.recv()
            try:
                self._dispatch(decode(data))
            except ValueError:
                logger.exception("dropped a malformed message from the engine core")

    def _dispatch(self, message: Message) -> None:
        if isinstance(message, Outputs):
            self._route(message)
        elif isinstance(message, RequestError):
            if message.request_id in self._request_of:
                request = self._end_sample(message.request_id)
                request.queue.put_nowait(CoreRequestError(message.code, message.message))
        elif isinstance(message, LoadStats):
            self.last_load = message
            waiter = self._load_waiters.get(message.query_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(message)
        elif isinstance(message, Ready):
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(message)
        elif isinstance(message, Fatal):
            self._set_dead(f"engine core failed: {message.message.strip().splitlines()[-1]}")
            logger.error("engine core failed:\n%s", message.message)

    def _route(self, message: Outputs) -> None:
        for output, timing in zip(message.outputs, message.timings):
            request_id = self._request_of.get(output.request_id)
            if request_id is None:
                continue  # cancelled by its consumer: the abort is on its way
            request = self._requests[request_id]
            index = request.samples[output.request_id]
            request.queue.put_nowait(CoreOutput(output, timing, index))
            if output.finish_reason is not None:
                self._end_sample(output.request_id)

    def _set_dead(self, reason: str) -> None:
        self._dead = self._dead or reason  # the first reason is the useful one
        self._failed.set()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(reason))
        self._fail_all("unavailable", reason)

    def _fail_all(self, code: str, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        for request in self._requests.values():
            request.queue.put_nowait(CoreRequestError(code, reason))
        self._requests.clear()
        self._request_of.clear()
        for waiter in self._load_waiters.values():
            if not waiter.done():
                waiter.set_exception(RuntimeError(reason))
