"""Restart with backoff: how ``pdserve up`` and the local actuator keep a crashed child running.

NOTE (restart policy). A child that exits without being asked to is restarted after a delay that
doubles with each exit inside a sliding window (``first_delay_s``, ``2×``, … capped at
``max_delay_s``), so a child that crashes at start-up does not spin the machine. After
``max_failures`` exits inside ``window_s`` it is given up: one line says so, and whoever owns the
child decides whether the rest can still serve. Exits older than the window are forgotten, so a
child that crashes once a day is restarted every time, at once.

Budgets count per cause (:class:`RestartBudgets`): what a child died of is its last error line
(numbers and addresses blanked, so the same crash reads the same each time) or its exit status.
A start-up that keeps failing the same way is given up after ``max_failures``; crashes of
different causes (a request that killed an engine, a node SIGKILLed, the OOM killer) do not add
up into one give-up. A request that kills engines is stopped at the router (quarantine), not by
retiring the pool it walked through.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from launcher.processes import ManagedProcess, StartupError, last_error

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """Backoff and give-up bounds (seconds); see the module NOTE."""

    first_delay_s: float = 0.5
    max_delay_s: float = 10.0
    max_failures: int = 5
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if not 0 <= self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 <= first_delay_s <= max_delay_s")
        if self.max_failures < 1 or self.window_s <= 0:
            raise ValueError("need max_failures >= 1 and window_s > 0")


class RestartBudget:
    """The exits of one child (or one pool) inside the policy's window."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._exits: deque[float] = deque()

    def failed(self) -> float | None:
        """Record an exit now; the delay before restarting, or None: give up."""
        now = self.clock()
        self._exits.append(now)
        while self._exits and now - self._exits[0] > self.policy.window_s:
            self._exits.popleft()
        count = len(self._exits)
        if count >= self.policy.max_failures:
            return None
        return min(self.policy.first_delay_s * 2 ** (count - 1), self.policy.max_delay_s)

    def describe(self) -> str:
        return f"{len(self._exits)} exits in {self.policy.window_s:g} s"


_VARYING = re.compile(r"0x[0-9a-fA-F]+|\d+")
MAX_CAUSES = 64  # distinct causes remembered per child or pool (the oldest are forgotten)


def exit_cause(process: ManagedProcess) -> str:
    """What ``process`` (exited) died of: its last error line with numbers blanked, or its
    exit status when the log says nothing of an error."""
    line = last_error(process.log_tail(60))
    if line == "no output" or not re.search(r"Error|Exception|Killed|fatal", line, re.I):
        return f"exit status {process.proc.returncode}"
    return _VARYING.sub("N", line)[:200]


class RestartBudgets:
    """One :class:`RestartBudget` per cause of exit (see the module NOTE)."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.clock = clock
        self._budgets: dict[str, RestartBudget] = {}

    def failed(self, cause: str) -> float | None:
        """Record an exit of ``cause`` now; the delay before restarting, or None: give up."""
        budget = self._budgets.pop(cause, None) or RestartBudget(self.policy, self.clock)
        self._budgets[cause] = budget  # most recent last
        while len(self._budgets) > MAX_CAUSES:
            del self._budgets[next(iter(self._budgets))]
        return budget.failed()

    def describe(self, cause: str) -> str:
        budget = self._budgets.get(cause)
        counted = budget.describe() if budget is not None else "no exits"
        return f"{counted} of this cause: {cause}"


StartFn = Callable[[], Awaitable[ManagedProcess]]


class Supervised:
    """One child kept running by :meth:`check` (called periodically by its owner).

    ``start`` makes a new process (and may wait until it serves; a StartupError there counts as
    one more exit). ``process`` is the current one; ``gave_up`` is set once the budget is spent;
    ``restarts`` counts the restarts done."""

    def __init__(self, name: str, process: ManagedProcess, start: StartFn,
                 policy: RestartPolicy) -> None:  # fmt: skip
        self.name = name
        self.process = process
        self.start = start
        self.budgets = RestartBudgets(policy)
        self.gave_up = False
        self.restarts = 0
        self._restart: asyncio.Task[None] | None = None

    @property
    def restarting(self) -> bool:
        return self._restart is not None and not self._restart.done()

    def check(self) -> bool:
        """Notice an exit and schedule the restart; True when a restart began now."""
        if self.gave_up or self.restarting or self.process.alive:
            return False
        code = self.process.proc.returncode
        self.process.kill_orphans()  # what it started (an engine core, a node) goes with it
        cause = exit_cause(self.process)
        delay = self.budgets.failed(cause)
        if delay is None:
            self.gave_up = True
            logger.error("%s exited (%s) and keeps exiting (%s): not restarting it; log %s",
                         self.name, code, self.budgets.describe(cause), self.process.log_path)  # fmt: skip
            return False
        logger.warning("%s exited unexpectedly (%s): restarting in %.1f s; log %s",
                       self.name, code, delay, self.process.log_path)  # fmt: skip
        self._restart = asyncio.ensure_future(self._run_restart(delay))
        return True

    async def _run_restart(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        try:
            self.process = await self.start()
        except StartupError as exc:  # seen as one more exit by the next check
            logger.error("%s did not restart: %s", self.name, exc)
            return
        self.restarts += 1
        logger.warning("%s restarted (pid %d)", self.name, self.process.pid)

    async def cancel(self) -> None:
        """Stop a restart in progress (the cluster is stopping)."""
        if self._restart is not None:
            self._restart.cancel()
            await asyncio.gather(self._restart, return_exceptions=True)
