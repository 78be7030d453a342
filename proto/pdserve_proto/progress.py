"""Is a node's engine making progress? The meaning of the liveness fields of ``NodeLoad``: one
rule, used by the router (routing, /ready, migration) and by the launcher's node watchdog
(``launcher/watchdog.py``), both fed the node's reports. No protobuf, no clock.

NOTE (the rule). A node reports ``engine_steps``, the turns of its engine-core loop so far, and
``num_requests``, the requests it holds. A node holding requests whose ``engine_steps`` has not
moved for ``timeout_s`` is *stalled*: its engine core is wedged (SIGSTOP, a step blocked in a
syscall, a lock a stuck I/O thread holds), whatever it answered before. An idle node is never
stalled (nothing needs its loop to turn), and silence counts like a report that says nothing
moved: a node that stopped reporting while it held requests stalls too (a frozen frontend).
A request that waits inside a turning loop (a slow KV load, a grammar compile) keeps the node
live; the per-token deadline of the router's flow is what bounds such a request.

The clock starts when the node is first seen holding requests (or at its last report that
moved), so work that arrives at an idle node gets the whole bound. Times are the caller's
monotonic seconds; nothing here reads a clock.
"""

from __future__ import annotations

from pdserve_proto.nodes import NodeLoad


class ProgressWatch:
    """What one observer knows of one node's progress (see the module NOTE)."""

    def __init__(self, timeout_s: float, now_s: float) -> None:
        if timeout_s <= 0:
            raise ValueError(f"the progress timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self._steps: int | None = None
        self._busy = False  # the last report held requests
        self._since_s = now_s  # last report that moved, or that found the node idle

    def observe(self, load: NodeLoad, now_s: float) -> None:
        """Take a report received at ``now_s``."""
        moved = load.engine_steps != self._steps
        if moved or not self._busy or load.num_requests == 0:
            self._since_s = now_s
        self._steps = load.engine_steps
        self._busy = load.num_requests > 0

    def stalled_for(self, now_s: float) -> float:
        """Seconds the node has held requests without its loop turning (0: live or idle)."""
        return now_s - self._since_s if self._busy else 0.0

    def stalled(self, now_s: float) -> bool:
        return self.stalled_for(now_s) >= self.timeout_s
