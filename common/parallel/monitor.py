"""Rank 0's watch over its tensor-parallel workers: a dead worker, or a step that never ends,
fails the group within seconds, whatever the backend.

NOTE: why a watcher. On gloo a peer that dies closes its sockets, so a collective waiting for it
fails at once. NCCL does not notice: the surviving ranks' kernels spin until the process group's
watchdog fires (the group timeout, 120 s). So a thread on rank 0 waits on the workers'
process sentinels and on the deadline of the step in progress, and on the first failure it
calls ``on_failure`` once, which aborts the communicators (``ProcessGroup.abort``: NCCL's
kernels return) and kills the remaining workers (a gloo wait on a live but stuck peer ends when
the peer's sockets close). The engine thread then sees its collective fail, or the failure
recorded here (``check``), and raises ``TensorParallelError``.

```
engine thread   execute ─ broadcast ─ forward (blocked in a collective) ──────▶ fails ─▶ raise
monitor thread  wait(sentinels, deadline) ── rank k dies ─▶ on_failure: abort, kill ┘
```
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import wait
from typing import Any

_POLL_S = 0.5  # how often the deadline is looked at when no process exits


class RankMonitor:
    """Watches ``workers`` (``multiprocessing`` processes: ``sentinel``, ``pid``, ``exitcode``;
    worker ``i`` is rank ``i + 1``) from a daemon thread.

    ``on_failure(reason)`` runs once, on the monitor thread, at the first worker exit or when a
    ``step()`` lasts longer than ``step_timeout_s``. ``stop()`` ends the watch without calling
    it (a clean shutdown, whose workers exit on purpose)."""

    def __init__(
        self,
        workers: Sequence[Any],
        on_failure: Callable[[str], None],
        step_timeout_s: float,
    ) -> None:
        self.workers = list(workers)
        self.step_timeout_s = step_timeout_s
        self.failure: str | None = None  # why the group failed, once it has
        self._on_failure = on_failure
        self._deadline: float | None = None
        self._failed = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Marks a call that waits on the group (a step, a KV exchange): it must end within
        ``step_timeout_s``. Not reentrant (the engine thread is the only caller)."""
        self._deadline = time.monotonic() + self.step_timeout_s
        try:
            yield
        finally:
            self._deadline = None

    def wait_failed(self, timeout_s: float) -> str | None:
        """The failure, waiting up to ``timeout_s`` for one to be recorded (a collective error
        may be seen a moment before the exit that caused it)."""
        self._failed.wait(timeout_s)
        return self.failure

    def stop(self) -> None:
        """End the watch (idempotent); ``on_failure`` is not called after this returns."""
        if self._stopping:
            return
        self._stopping = True
        os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    # -- the monitor thread ------------------------------------------------------------------
    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.workers, start=1)}
        while True:
            ready = wait([self._wake_r, *sentinels], timeout=self._timeout())
            if self._stopping:
                return
            reason = self._exited(ready, sentinels) or self._overdue()
            if reason is not None:
                self._fail(reason)
                return

    def _timeout(self) -> float:
        deadline = self._deadline
        if deadline is None:
            return _POLL_S
        return min(_POLL_S, max(0.0, deadline - time.monotonic()))

    def _exited(self, ready: list[Any], sentinels: dict[int, int]) -> str | None:
        for sentinel in ready:
            rank = sentinels.get(sentinel)
            if rank is not None:
                proc = self.workers[rank - 1]
                proc.join(timeout=1)  # reap it, for its exit code
                return (
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )
        return None

    def _overdue(self) -> str | None:
        deadline = self._deadline
        if deadline is None or time.monotonic() < deadline:
            return None
        return f"a tensor-parallel step ran past {self.step_timeout_s:g} s (a rank is stuck)"

    def _fail(self, reason: str) -> None:
        self.failure = reason
        try:
            self._on_failure(reason)
        finally:
            self._failed.set()
