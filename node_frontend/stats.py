"""Recent latency percentiles and token rates: the frontend's part of a node's ``NodeLoad``.

Each series keeps the samples of the last ``span_s`` seconds (30 s by default, capped in count so
memory stays bounded under load). Times are ``time.monotonic()`` seconds; latencies milliseconds.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque

import numpy as np
from pdserve_proto.nodes import NodeLoad


class Window:
    """Timestamped samples of the last ``span_s`` seconds."""

    def __init__(self, span_s: float = 30.0, max_samples: int = 50_000) -> None:
        self.span_s = span_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)
        self._created = time.monotonic()

    def add(self, value: float, now: float | None = None) -> None:
        self._samples.append((time.monotonic() if now is None else now, value))

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.span_s:
            self._samples.popleft()

    def percentiles(self, qs: tuple[float, ...], now: float | None = None) -> list[float]:
        """Percentiles (0-100) of the window's values; zeros when it is empty."""
        self._prune(time.monotonic() if now is None else now)
        if not self._samples:
            return [0.0] * len(qs)
        values = np.fromiter((v for _, v in self._samples), dtype=np.float64)
        return [float(p) for p in np.percentile(values, qs)]

    def rate(self, now: float | None = None) -> float:
        """Sum of the window's values per second (over the span, or the uptime if shorter)."""
        now = time.monotonic() if now is None else now
        self._prune(now)
        elapsed = min(self.span_s, now - self._created)
        total = sum(v for _, v in self._samples)
        return total / elapsed if elapsed > 0 else 0.0


class NodeStats:
    """What a node measured recently: TTFT (arrival at the node → first token leaves it), ITL
    (gap between successive tokens of one request), prompt tokens computed and tokens generated.
    """

    def __init__(self, span_s: float = 30.0) -> None:
        self.ttft_ms = Window(span_s)
        self.itl_ms = Window(span_s)
        self.prefill_tokens = Window(span_s)
        self.decode_tokens = Window(span_s)

    def with_latencies(self, load: NodeLoad) -> NodeLoad:
        """``load`` with this window's latency percentiles and token rates filled in."""
        ttft = self.ttft_ms.percentiles((50, 90))
        itl = self.itl_ms.percentiles((50, 90))
        return dataclasses.replace(
            load,
            ttft_p50_ms=ttft[0],
            ttft_p90_ms=ttft[1],
            itl_p50_ms=itl[0],
            itl_p90_ms=itl[1],
            prefill_tokens_per_s=self.prefill_tokens.rate(),
            decode_tokens_per_s=self.decode_tokens.rate(),
        )


class TokenTimer:
    """Per-request clock: records TTFT on the first token and ITL on each later one."""

    def __init__(self, stats: NodeStats) -> None:
        self.stats = stats
        self.arrival = time.monotonic()
        self._last: float | None = None

    def tokens(self, count: int) -> None:
        """``count`` new tokens leave the node now."""
        if count <= 0:
            return
        now = time.monotonic()
        if self._last is None:
            self.stats.ttft_ms.add((now - self.arrival) * 1e3, now)
        else:
            self.stats.itl_ms.add((now - self._last) * 1e3 / count, now)
        self._last = now
        self.stats.decode_tokens.add(count, now)
