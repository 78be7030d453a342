"""Steady streamed load on a router from a background thread, every answer checked against the
offline engine's text (benchmarks.chaos's request loop), and per-phase counts of what went wrong.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

from benchmarks.chaos import PROMPTS, Outcome, drive


@dataclass(frozen=True)
class Tally:
    """Requests that ended in a phase: how many, and how many failed, were cut short, differed."""

    requests: int
    failed: int
    truncated: int
    different: int
    examples: tuple[str, ...]

    @property
    def bad(self) -> int:
        return self.failed + self.truncated + self.different


class Load:
    """``streams`` concurrent loops of streamed greedy completions (``PROMPTS`` in turn) against
    ``url`` until ``stop()``; ``expected[i]`` is the text for ``PROMPTS[i]``. Nothing is retried.
    """

    def __init__(self, url: str, expected: list[str], streams: int) -> None:
        assert len(expected) == len(PROMPTS)
        self.outcomes: list[Outcome] = []
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(
            target=self._loop.run_until_complete,
            args=(drive(url, expected, streams, self._stop, self.outcomes),),
            daemon=True,
        )

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=120)
        self._loop.close()

    def tally(self, since: float = 0.0, until: float = float("inf")) -> Tally:
        """What ended in ``[since, until)`` (``time.monotonic()`` seconds)."""
        ended = [o for o in list(self.outcomes) if since <= o.end < until]
        kinds = [o.problem.split(":")[0] for o in ended]
        problems = tuple(o.problem for o in ended if o.problem)[:3]
        return Tally(len(ended), kinds.count("failed"), kinds.count("truncated"),
                     kinds.count("different"), problems)  # fmt: skip

    def wait_requests(self, count: int, timeout_s: float = 120.0) -> None:
        """Until ``count`` more requests have ended (the load is flowing)."""
        target = len(self.outcomes) + count
        deadline = time.monotonic() + timeout_s
        while len(self.outcomes) < target:
            assert time.monotonic() < deadline, f"load stalled: {len(self.outcomes)} requests"
            time.sleep(0.2)
