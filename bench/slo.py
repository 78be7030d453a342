"""SLO metrics shared by the router's live ``/slo`` report and ``pdserve bench``.

One definition of every number, so a benchmark and the live router can be compared directly:

- TTFT: ``first_token_s - start_s``.
- ITL: the gaps between successive token arrival times (``token_times_s``). When one arrival
  carries several tokens (a batched stream item, one SSE chunk) that is a single arrival, so a
  request can have fewer ITLs than ``output_tokens - 1``.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, vLLM's definition. Undefined for a request with
  one output token; such a request has no ITL either, and it *meets* the TPOT and ITL SLOs
  (there is no inter-token latency to violate). Undefined values are left out of percentiles.
- E2E: ``end_s - start_s``.
- A request meets the ITL SLO when *every* one of its ITLs is within the bound: a streaming
  user feels the worst stall, not the average (the average is what TPOT bounds).
- A failed request is left out of every latency statistic, but it counts in the denominator of
  SLO attainment and never towards goodput: failing fast must not look good.
- Goodput (DistServe): completed requests per second meeting *all* configured SLOs. With no SLO
  configured every successful request qualifies, so goodput equals request throughput.
- Percentiles use linear interpolation between closest ranks (numpy's default ``"linear"``):
  p of ``[10, 20, 30, 40]`` at 90 is ``37``.

All timestamps are seconds from one monotonic clock (``time.perf_counter``); reports are in ms.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2e")
SCHEMA = "pdserve.slo_report/v1"


@dataclass(frozen=True)
class SLOConfig:
    """Latency bounds in milliseconds; ``None`` means "no SLO on this metric"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        for name, bound in self.bounds().items():
            if not (math.isfinite(bound) and bound > 0):
                raise ValueError(f"SLO {name} must be a positive number of ms, got {bound}")

    def bounds(self) -> dict[str, float]:
        """The configured bounds, keyed by metric name (``"ttft"``, ...), in METRICS order."""
        values = {m: getattr(self, f"{m}_ms") for m in METRICS}
        return {m: v for m, v in values.items() if v is not None}

    def __str__(self) -> str:
        return ",".join(f"{m}={v:g}" for m, v in self.bounds().items()) or "none"


def parse_slo(spec: str) -> SLOConfig:
    """Parse ``"ttft=200,tpot=50,e2e=2000"`` (ms; a trailing ``ms`` is allowed).

    An empty string means no SLO. Raises ValueError on an unknown or repeated metric, a missing
    ``=``, or a value that is not a positive number.
    """
    bounds: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip().lower(), value.strip().lower().removesuffix("ms")
        if not sep or name not in METRICS:
            raise ValueError(f"bad SLO item {item!r}: expected one of {METRICS} as NAME=MS")
        if name in bounds:
            raise ValueError(f"SLO {name} given twice in {spec!r}")
        try:
            bounds[name] = float(value)
        except ValueError:
            raise ValueError(f"SLO {name} must be a number of ms, got {value!r}") from None
    return SLOConfig(**{f"{m}_ms": v for m, v in bounds.items()})


@dataclass(frozen=True)
class RequestRecord:
    """What one request did, as seen by whoever measures it (router or benchmark client).

    ``token_times_s`` are the arrival times of token-carrying messages, first token included
    (so ``token_times_s[0] == first_token_s`` for a measurer that records both). A successful
    request has a first token; a failed one may have any prefix of its stream.
    """

    start_s: float
    first_token_s: float | None
    token_times_s: list[float]
    end_s: float
    prompt_tokens: int
    output_tokens: int
    success: bool = True
    error: str | None = None

    def __post_init__(self) -> None:
        if self.end_s < self.start_s:
            raise ValueError("end_s is before start_s")
        if self.success and (self.first_token_s is None or self.output_tokens < 1):
            raise ValueError("a successful request has a first token and output_tokens >= 1")
        if self.first_token_s is not None and not self.start_s <= self.first_token_s <= self.end_s:
            raise ValueError("first_token_s must lie in [start_s, end_s]")
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise ValueError("token counts must be >= 0")

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.first_token_s is None or self.output_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> np.ndarray:
        """Gaps between successive token arrivals, shape ``(len(token_times_s) - 1,)``."""
        return np.diff(np.asarray(self.token_times_s, dtype=np.float64))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestRecord:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class LatencyStats:
    """Distribution of one latency metric in milliseconds over ``count`` samples (>= 1)."""

    count: int
    mean_ms: float
    median_ms: float
    p90_ms: float
    p99_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, values_ms: np.ndarray) -> LatencyStats | None:
        """Statistics of ``values_ms`` (1-D); None when it is empty."""
        if values_ms.size == 0:
            return None
        p50, p90, p99 = np.percentile(values_ms, [50, 90, 99])  # linear interpolation
        return cls(
            count=int(values_ms.size),
            mean_ms=float(values_ms.mean()),
            median_ms=float(p50),
            p90_ms=float(p90),
            p99_ms=float(p99),
            min_ms=float(values_ms.min()),
            max_ms=float(values_ms.max()),
        )


@dataclass(frozen=True)
class SLOReport:
    """Summary of a set of requests over ``duration_s`` against ``slo``.

    Throughputs are per second of ``duration_s`` and count successful requests only.
    ``attainment`` holds, for each configured metric, the fraction of *all* requests meeting
    it; ``overall_attainment`` the fraction meeting every configured one (0 with no requests).
    """

    slo: SLOConfig
    duration_s: float
    num_requests: int
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    goodput: float
    attainment: dict[str, float]
    overall_attainment: float
    ttft: LatencyStats | None
    tpot: LatencyStats | None
    itl: LatencyStats | None
    e2e: LatencyStats | None
    errors: dict[str, int] = field(default_factory=dict)

    def latency(self, metric: str) -> LatencyStats | None:
        """The stats of ``metric`` (one of METRICS)."""
        return getattr(self, metric)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SLOReport:
        kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        kwargs["slo"] = SLOConfig(**data["slo"])
        for metric in METRICS:
            stats = data.get(metric)
            kwargs[metric] = None if stats is None else LatencyStats(**stats)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> SLOReport:
        return cls.from_dict(json.loads(text))

    def to_markdown(self) -> str:
        """A human summary: a throughput table, then one latency row per metric."""
        bounds = self.slo.bounds()
        lines = [
            f"SLO: {self.slo}",
            "",
            "| requests | failed | duration (s) | req/s | goodput (req/s) | "
            "input tok/s | output tok/s | SLO attainment |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {self.num_requests} | {self.num_failed} | {self.duration_s:.2f} | "
            f"{self.request_throughput:.2f} | {self.goodput:.2f} | {self.input_throughput:.1f} | "
            f"{self.output_throughput:.1f} | {self.overall_attainment:.1%} |",
            "",
            "| metric | mean (ms) | median | p90 | p99 | min | max | count | SLO (ms) | met |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for metric in METRICS:
            lines.append(_markdown_row(metric, self.latency(metric), bounds, self.attainment))
        if self.errors:
            lines += ["", "| error | count |", "| --- | ---: |"]
            lines += [f"| {err} | {n} |" for err, n in self.errors.items()]
        return "\n".join(lines) + "\n"


def _markdown_row(
    metric: str, stats: LatencyStats | None, bounds: dict[str, float], met: dict[str, float]
) -> str:
    slo = f"{bounds[metric]:g}" if metric in bounds else "-"
    attained = f"{met[metric]:.1%}" if metric in met else "-"
    if stats is None:
        return f"| {metric.upper()} | - | - | - | - | - | - | 0 | {slo} | {attained} |"
    values = [
        getattr(stats, f"{name}_ms") for name in ("mean", "median", "p90", "p99", "min", "max")
    ]
    cells = " | ".join(f"{v:.2f}" for v in values)
    return f"| {metric.upper()} | {cells} | {stats.count} | {slo} | {attained} |"


def _per_request_ms(ok: list[RequestRecord]) -> dict[str, np.ndarray]:
    """Per successful request: ttft, tpot (NaN if undefined), worst itl (NaN if none), e2e."""
    nan = float("nan")
    return {
        "ttft": np.array([r.ttft_s for r in ok], dtype=np.float64) * 1e3,
        "tpot": np.array([nan if r.tpot_s is None else r.tpot_s for r in ok]) * 1e3,
        "itl": np.array([r.itls_s.max() if len(r.token_times_s) > 1 else nan for r in ok]) * 1e3,
        "e2e": np.array([r.e2e_s for r in ok], dtype=np.float64) * 1e3,
    }


def _attainment(
    per_request: dict[str, np.ndarray], slo: SLOConfig, num_requests: int
) -> tuple[dict[str, float], np.ndarray]:
    """Fraction of all requests meeting each configured SLO, and the per-success all-met mask.

    Undefined values (NaN: no TPOT, no ITL) meet their SLO. Failed requests meet nothing, which
    the denominator ``num_requests`` accounts for.
    """
    all_met = np.ones(per_request["e2e"].size, dtype=bool)
    attainment: dict[str, float] = {}
    for metric, bound in slo.bounds().items():
        values = per_request[metric]
        met = np.isnan(values) | (values <= bound)
        attainment[metric] = float(met.sum() / num_requests) if num_requests else 0.0
        all_met &= met
    return attainment, all_met


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: SLOConfig | None = None
) -> SLOReport:
    """Summarize ``records`` observed over ``duration_s`` seconds (>= 0; 0 gives 0 rates).

    Pure: reads the records, returns a new report. See the module docstring for definitions.
    """
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    slo = slo or SLOConfig()
    ok = [r for r in records if r.success]
    per_request = _per_request_ms(ok)
    attainment, all_met = _attainment(per_request, slo, len(records))

    def rate(count: float) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    itls = [r.itls_s for r in ok]
    return SLOReport(
        slo=slo,
        duration_s=duration_s,
        num_requests=len(records),
        num_completed=len(ok),
        num_failed=len(records) - len(ok),
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        request_throughput=rate(len(ok)),
        input_throughput=rate(input_tokens),
        output_throughput=rate(output_tokens),
        goodput=rate(int(all_met.sum())),
        attainment=attainment,
        overall_attainment=float(all_met.sum() / len(records)) if records else 0.0,
        ttft=LatencyStats.of(per_request["ttft"]),
        tpot=LatencyStats.of(per_request["tpot"][~np.isnan(per_request["tpot"])]),
        itl=LatencyStats.of(np.concatenate(itls) * 1e3 if itls else np.empty(0)),
        e2e=LatencyStats.of(per_request["e2e"]),
        errors=dict(Counter(r.error or "unknown" for r in records if not r.success)),
    )


class LiveSLOStats:
    """Thread-safe rolling window of finished requests, summarized on demand.

    The router calls ``record()`` as each request finishes (any thread); ``/slo`` calls
    ``report()``. The window keeps requests that ended in the last ``window_s`` seconds and at
    most ``max_records`` of them (the newest); at least one of the two must be set so memory
    stays bounded. Rates are computed over the span the kept records actually cover: from the
    later of (creation, ``now - window_s``, end of the last record dropped for count) to now.
    """

    def __init__(
        self,
        slo: SLOConfig | None = None,
        window_s: float | None = 60.0,
        max_records: int | None = 10_000,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if window_s is None and max_records is None:
            raise ValueError("set window_s, max_records or both: the window must be bounded")
        if (window_s is not None and window_s <= 0) or (
            max_records is not None and max_records < 1
        ):
            raise ValueError("window_s must be > 0 and max_records >= 1")
        self._slo = slo or SLOConfig()
        self._window_s = window_s
        self._max_records = max_records
        self._clock = clock
        self._lock = threading.Lock()
        self._records: deque[RequestRecord] = deque()
        self._since = clock()

    @property
    def slo(self) -> SLOConfig:
        return self._slo

    @slo.setter
    def slo(self, slo: SLOConfig) -> None:
        self._slo = slo  # an attribute swap is atomic; report() reads it once

    def record(self, record: RequestRecord) -> None:
        """Add one finished request (timestamps on this object's clock)."""
        with self._lock:
            self._records.append(record)
            if self._max_records is not None and len(self._records) > self._max_records:
                dropped = self._records.popleft()
                self._since = max(self._since, dropped.end_s)
            self._expire(self._clock())

    def report(self) -> SLOReport:
        """Summary of the current window; does not modify the window's contents."""
        now = self._clock()
        with self._lock:
            self._expire(now)
            since = self._since
            records = list(self._records)
        if self._window_s is not None:
            since = max(since, now - self._window_s)
            # Records are appended at finish, so out-of-order ends are rare; filter them exactly.
            records = [r for r in records if r.end_s >= since]
        return summarize(records, max(0.0, now - since), self._slo)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def _expire(self, now: float) -> None:
        """Drop records that ended before the window (caller holds the lock)."""
        if self._window_s is None:
            return
        cutoff = now - self._window_s
        while self._records and self._records[0].end_s < cutoff:
            self._records.popleft()
