"""The engine-core process of a node: a busy loop around one ``EngineCore``.

NOTE: the loop. Each turn drains every message waiting on the input socket (adds, aborts, load
queries), then runs one ``EngineCore.step()`` and pushes that step's outputs as one ``Outputs``
message. With nothing to do it blocks on the input socket (waking once a second to check that its
parent is still alive) instead of spinning. Messages are handled only between steps, so a request
added while a step runs joins the next one; that is also why a load report is always consistent.
A load report carries the loop's turns so far (``engine_steps``): a core that holds requests and
stops turning is stuck, which its node's router and `up`'s watchdog act on.

Sockets: ZeroMQ ``ipc://`` in a private (0700) directory that the frontend created and bound; this
process connects a PULL socket (input) and a PUSH socket (output). Everything on them is a
``common.core_messages`` message (msgpack). A refused request (``ValueError``,
``QueueFullError``, or an ``AddRequest`` that does not decode) is answered with a
``RequestError`` for that request; any other malformed message is logged and dropped. A step
that raises fails the request that caused it (``request_failed``; ``common/step_faults.py``)
and the loop goes on; an exception no request can be blamed for is fatal: the process sends
``Fatal`` and exits non-zero.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

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
    engine_config_from_dict,
    malformed_request_id,
)
from common.engine import EngineCore, QueueFullError
from common.host_memory import freeze_startup_objects
from common.request import RequestStatus
from common.step_outputs import EngineCoreOutput

if TYPE_CHECKING:
    from common.kv_connector import ConnectorFactory

logger = logging.getLogger(__name__)

_PARENT_CHECK_MS = 1000


@dataclass
class _Clock:
    """Per-request timestamps (``time.monotonic``) until the request's first output."""

    arrival: float
    scheduled: float | None = None  # first left WAITING (scheduled, or parked for a load)
    load_start: float | None = None
    load_end: float | None = None

    def timing(self, now: float) -> RequestTiming:
        scheduled = self.scheduled if self.scheduled is not None else now
        load_ms = 0.0
        if self.load_start is not None:
            load_ms = ((self.load_end or now) - self.load_start) * 1e3
        compute_ms = max(0.0, (now - scheduled) * 1e3 - load_ms)
        return RequestTiming((scheduled - self.arrival) * 1e3, load_ms, compute_ms)


class RequestClocks:
    """Times requests from arrival to first output, by watching their status between steps."""

    def __init__(self) -> None:
        self._clocks: dict[str, _Clock] = {}

    def add(self, request_id: str) -> None:
        self._clocks[request_id] = _Clock(time.monotonic())

    def drop(self, request_id: str) -> None:
        self._clocks.pop(request_id, None)

    def after_step(self, engine: EngineCore, step_start: float) -> None:
        """Stamp requests whose status changed during the step that began at ``step_start``."""
        waiting_kv = RequestStatus.WAITING_FOR_REMOTE_KV
        for request_id, clock in self._clocks.items():
            status = engine.request_status(request_id)
            if clock.scheduled is None and status != RequestStatus.WAITING:
                clock.scheduled = step_start
            if status == waiting_kv and clock.load_start is None:
                clock.load_start = step_start
            elif clock.load_start is not None and clock.load_end is None and status != waiting_kv:
                clock.load_end = step_start  # loads land before the step schedules

    def first_output(self, request_id: str) -> RequestTiming | None:
        """The request's timing if this is its first output (then it stops being tracked)."""
        clock = self._clocks.pop(request_id, None)
        return None if clock is None else clock.timing(time.monotonic())


class EngineCoreProc:
    """Owns the engine and both sockets; :meth:`run` returns after a ``Shutdown``."""

    def __init__(self, engine: EngineCore, input_socket: zmq.Socket, output_socket: zmq.Socket):
        self.engine = engine
        self.input = input_socket
        self.output = output_socket
        self.clocks = RequestClocks()
        self._parent_pid = os.getppid()
        self._stopping = False
        self.num_steps = 0  # turns of the loop: the liveness count a node reports (LoadStats)

    def run(self) -> None:
        next_check = time.monotonic() + _PARENT_CHECK_MS / 1e3
        while not self._stopping:
            self._receive(block=not self.engine.has_unfinished())
            if not self._stopping:
                self._step()
            if time.monotonic() > next_check:  # busy for long: still check now and then
                next_check = time.monotonic() + _PARENT_CHECK_MS / 1e3
                self._check_parent()

    def _check_parent(self) -> None:
        """Stop if the frontend died without a ``Shutdown`` (we were re-parented)."""
        if not self._stopping and os.getppid() != self._parent_pid:
            logger.warning("frontend process is gone: engine core exits")
            self._stopping = True

    # -- input -------------------------------------------------------------------------------
    def _receive(self, block: bool) -> None:
        """Handle every waiting message; with ``block``, first wait for one."""
        while block and not self._stopping and not self.input.poll(_PARENT_CHECK_MS):
            self._check_parent()
        while not self._stopping:
            try:
                data = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode(data)
            except ValueError as e:
                self._refuse_malformed(data, e)
                continue
            self._handle(message)

    def _refuse_malformed(self, data: bytes, error: ValueError) -> None:
        """A message that does not decode never reaches the engine; the core stays up. An
        ``AddRequest`` whose id can still be read is refused, so its stream ends."""
        request_id = malformed_request_id(data)
        if request_id is None:
            logger.error("dropped a malformed message: %s", error)
        else:
            self._send(RequestError(request_id, "invalid_argument", str(error)))

    def _handle(self, message: Message) -> None:
        if isinstance(message, AddRequest):
            self._add(message)
        elif isinstance(message, AbortRequests):
            self._abort(message.request_ids)
        elif isinstance(message, GetLoad):
            self._send(self._load(message.query_id))
        elif isinstance(message, Shutdown):
            self._abort(self.engine.request_ids())
            self._stopping = True
        else:
            logger.error(
                "dropped a %s message: not one for the engine core", type(message).__name__
            )

    def _add(self, message: AddRequest) -> None:
        try:
            self.engine.add_request(
                message.request_id,
                message.prompt_token_ids,
                message.sampling_params,
                priority=message.priority,
                output_token_ids=message.output_token_ids or None,
                kv_handle=message.kv_handle,
                lora=message.lora,
            )
        except QueueFullError as e:
            self._send(RequestError(message.request_id, "resource_exhausted", str(e)))
            return
        except ValueError as e:
            self._send(RequestError(message.request_id, "invalid_argument", str(e)))
            return
        self.clocks.add(message.request_id)

    def _abort(self, request_ids: list[str]) -> None:
        held = [rid for rid in request_ids if self.engine.request_status(rid) is not None]
        self.engine.abort(request_ids)
        for request_id in request_ids:
            self.clocks.drop(request_id)
        if held:
            outputs = [EngineCoreOutput(rid, [], [], "abort") for rid in held]
            self._send(Outputs(outputs, [None] * len(outputs)))

    def _load(self, query_id: int) -> LoadStats:
        stats = msgspec.structs.asdict(self.engine.stats())
        return LoadStats(**stats, query_id=query_id, engine_steps=self.num_steps)

    # -- the step ----------------------------------------------------------------------------
    def _step(self) -> None:
        start = time.monotonic()
        outputs = self.engine.step()
        self.num_steps += 1
        self.clocks.after_step(self.engine, start)
        for request_id, reason in self.engine.take_refused():  # grammars that did not compile
            self.clocks.drop(request_id)
            self._send(RequestError(request_id, "invalid_argument", reason))
        for request_id, reason in self.engine.take_failed():  # a step failed because of it
            self.clocks.drop(request_id)
            self._send(RequestError(request_id, "request_failed", reason))
        if outputs:
            timings = [self.clocks.first_output(o.request_id) for o in outputs]
            self._send(Outputs(outputs, timings))

    def _send(self, message: Message) -> None:
        self.output.send(encode(message), copy=False)


def ready_message(engine: EngineCore) -> Ready:
    connector = engine.connector[0] if engine.connector else None
    return Ready(
        model=engine.config.model.model,
        vocab_size=engine.vocab_size,
        max_model_len=engine.max_model_len,
        block_size=engine.block_size,
        num_total_blocks=engine.runner.num_blocks,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        kv_fingerprint=connector.fingerprint if connector is not None else None,
        pid=os.getpid(),
    )


def run_engine_core(
    config: dict[str, Any],
    input_address: str,
    output_address: str,
    log_level: int = logging.INFO,
    connector_factory: ConnectorFactory | None = None,
) -> None:
    """Entry point of the engine-core process (a ``multiprocessing`` spawn target).

    ``config`` is ``engine_config_to_dict(EngineConfig)``: plain values only;
    ``connector_factory`` is handed to the engine (see ``EngineCore``). SIGINT and SIGTERM
    are ignored: the frontend drains first and then sends ``Shutdown``; if the frontend dies, the
    loop notices its parent is gone and exits.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    context = zmq.Context()
    input_socket = _socket(context, zmq.PULL, input_address)
    output_socket = _socket(context, zmq.PUSH, output_address)
    engine: EngineCore | None = None
    try:
        engine = EngineCore(engine_config_from_dict(config), connector_factory)
        freeze_startup_objects()  # this process runs this engine for its life
        output_socket.send(encode(ready_message(engine)))
        EngineCoreProc(engine, input_socket, output_socket).run()
    except BaseException:
        logger.exception("engine core failed")
        output_socket.send(encode(Fatal(traceback.format_exc(limit=20))), zmq.NOBLOCK)
        raise SystemExit(1) from None
    finally:
        if engine is not None:
            engine.close()
        gc.unfreeze()  # the exit's collection finds the startup objects again
        input_socket.close(linger=0)
        output_socket.close(linger=5000)  # let the last outputs reach the frontend
        context.term()


def _socket(context: zmq.Context, kind: int, address: str) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a burst of outputs
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(address)
    return sock
