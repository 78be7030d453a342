"""bench/slo.py against hand-computed values."""

from __future__ import annotations

import threading

import pytest

from bench.slo import (
    LatencyStats,
    LiveSLOStats,
    RequestRecord,
    SLOConfig,
    SLOReport,
    parse_slo,
    summarize,
)


def make(
    ttft_ms: float,
    itls_ms: list[float] = (),  # type: ignore[assignment]
    start_s: float = 0.0,
    prompt_tokens: int = 10,
) -> RequestRecord:
    """A successful request: first token after ttft_ms, then one token per ITL, ends on the last."""
    times = [start_s + ttft_ms / 1e3]
    for gap in itls_ms:
        times.append(times[-1] + gap / 1e3)
    return RequestRecord(
        start_s=start_s,
        first_token_s=times[0],
        token_times_s=times,
        end_s=times[-1],
        prompt_tokens=prompt_tokens,
        output_tokens=len(times),
    )


def failed(start_s: float = 0.0, error: str = "HTTP 500") -> RequestRecord:
    return RequestRecord(start_s, None, [], start_s + 0.5, 10, 0, success=False, error=error)


# --------------------------------------------------------------------------- percentiles


def test_percentiles_linear_interpolation() -> None:
    # Sorted TTFTs 10, 20, 30, 40 ms. Linear interpolation at rank q*(n-1):
    # median = 25, p90 at rank 2.7 = 30 + 0.7*10 = 37, p99 at rank 2.97 = 39.7.
    report = summarize([make(t) for t in (40, 10, 30, 20)], duration_s=1.0)
    ttft = report.ttft
    assert ttft is not None
    assert ttft.count == 4
    assert ttft.mean_ms == pytest.approx(25.0)
    assert ttft.median_ms == pytest.approx(25.0)
    assert ttft.p90_ms == pytest.approx(37.0)
    assert ttft.p99_ms == pytest.approx(39.7)
    assert (ttft.min_ms, ttft.max_ms) == pytest.approx((10.0, 40.0))


def test_itl_pools_every_gap_and_tpot_is_per_request_mean() -> None:
    # Request A: gaps 10, 30 (TPOT 20); request B: gaps 40 (TPOT 40).
    report = summarize([make(5, [10, 30]), make(5, [40])], duration_s=1.0)
    assert report.itl is not None and report.tpot is not None
    assert report.itl.count == 3
    assert report.itl.median_ms == pytest.approx(30.0)
    assert report.itl.mean_ms == pytest.approx(80 / 3)
    assert report.tpot.count == 2
    assert report.tpot.mean_ms == pytest.approx(30.0)
    # E2E = TTFT + sum of gaps.
    assert report.e2e is not None and report.e2e.max_ms == pytest.approx(45.0)


# --------------------------------------------------------------------------- SLO accounting


def test_goodput_and_attainment_mixed() -> None:
    slo = SLOConfig(ttft_ms=100, tpot_ms=20)
    records = [
        make(50, [10, 10]),  # meets both
        make(150, [10]),  # misses TTFT
        make(50, [30, 30]),  # misses TPOT
        make(50),  # one token: TPOT undefined, counts as met
        failed(),  # counts against everything
    ]
    report = summarize(records, duration_s=10.0, slo=slo)
    assert report.num_requests == 5 and report.num_completed == 4 and report.num_failed == 1
    assert report.attainment == pytest.approx({"ttft": 0.6, "tpot": 0.6})
    assert report.overall_attainment == pytest.approx(0.4)
    assert report.goodput == pytest.approx(0.2)  # 2 requests in 10 s
    assert report.request_throughput == pytest.approx(0.4)
    assert report.output_throughput == pytest.approx((3 + 2 + 3 + 1) / 10)
    assert report.input_throughput == pytest.approx(4.0)  # failed prompts not counted
    assert report.tpot is not None and report.tpot.count == 3  # the 1-token request has none


def test_itl_slo_bounds_the_worst_gap() -> None:
    slo = SLOConfig(itl_ms=50)
    report = summarize([make(5, [10, 60]), make(5, [40, 40]), make(5)], 1.0, slo)
    # The first request's mean gap (35) is fine but one stall of 60 ms misses; one token: met.
    assert report.attainment == pytest.approx({"itl": 2 / 3})


def test_single_token_request_has_no_itl() -> None:
    record = make(20)
    assert record.itls_s.size == 0 and record.tpot_s is None
    report = summarize([record], 1.0, SLOConfig(tpot_ms=1, itl_ms=1))
    assert report.itl is None and report.tpot is None
    assert report.overall_attainment == 1.0 and report.goodput == 1.0


def test_failed_request_excluded_from_latency() -> None:
    report = summarize(
        [failed(), failed(error="timeout"), make(30, [10])], 2.0, SLOConfig(ttft_ms=100)
    )
    assert report.ttft is not None and report.ttft.count == 1
    assert report.e2e is not None and report.e2e.max_ms == pytest.approx(40.0)
    assert report.errors == {"HTTP 500": 1, "timeout": 1}
    assert report.overall_attainment == pytest.approx(1 / 3)
    assert report.goodput == pytest.approx(0.5)


def test_empty_input() -> None:
    report = summarize([], duration_s=0.0, slo=SLOConfig(ttft_ms=100))
    assert report.num_requests == 0 and report.goodput == 0.0 and report.request_throughput == 0.0
    assert all(report.latency(m) is None for m in ("ttft", "tpot", "itl", "e2e"))
    assert report.attainment == {"ttft": 0.0} and report.overall_attainment == 0.0
    assert "| TTFT | - |" in report.to_markdown()


def test_no_slo_goodput_equals_throughput() -> None:
    report = summarize([make(10, [5]), failed()], duration_s=2.0)
    assert report.goodput == report.request_throughput == pytest.approx(0.5)


def test_record_validation() -> None:
    with pytest.raises(ValueError):
        RequestRecord(0.0, None, [], 1.0, 1, 1)  # success without a first token
    with pytest.raises(ValueError):
        RequestRecord(1.0, 1.5, [1.5], 0.5, 1, 1)  # ends before it starts
    with pytest.raises(ValueError):
        summarize([], duration_s=-1.0)


# --------------------------------------------------------------------------- parse / serialise


def test_parse_slo() -> None:
    assert parse_slo("ttft=200,tpot=50,e2e=2000") == SLOConfig(ttft_ms=200, tpot_ms=50, e2e_ms=2000)
    assert parse_slo(" TTFT = 200ms , itl=25 ") == SLOConfig(ttft_ms=200, itl_ms=25)
    assert parse_slo("") == SLOConfig()
    assert str(parse_slo("tpot=50,ttft=200")) == "ttft=200,tpot=50"


@pytest.mark.parametrize(
    "spec",
    ["ttft", "latency=5", "ttft=fast", "ttft=-5", "ttft=0", "ttft=inf", "ttft=1,ttft=2", "=5"],
)
def test_parse_slo_errors(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_slo(spec)


def test_report_json_roundtrip_and_markdown() -> None:
    slo = SLOConfig(ttft_ms=100, e2e_ms=1000)
    report = summarize([make(50, [10, 20]), make(150, [5]), failed()], 3.0, slo)
    back = SLOReport.from_json(report.to_json())
    assert back == report
    assert isinstance(back.ttft, LatencyStats)
    md = report.to_markdown()
    assert "| TTFT | 100.00 |" in md and "| 100 | 33.3% |" in md and "| 1000 | 66.7% |" in md
    assert "| HTTP 500 | 1 |" in md


def test_record_dict_roundtrip() -> None:
    record = make(10, [1, 2])
    assert RequestRecord.from_dict(record.to_dict()) == record


# --------------------------------------------------------------------------- live window


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_live_window_by_time() -> None:
    clock = FakeClock()
    live = LiveSLOStats(SLOConfig(ttft_ms=100), window_s=10.0, max_records=None, clock=clock)
    clock.now = 5.0
    live.record(make(50, start_s=1.0))
    live.record(make(200, start_s=2.0))
    report = live.report()
    assert report.num_requests == 2 and report.duration_s == pytest.approx(5.0)
    assert report.overall_attainment == pytest.approx(0.5)
    clock.now = 11.5  # both ended near t=1..2.2 -> the first falls out of [1.5, 11.5]
    report = live.report()
    assert report.num_requests == 1 and report.duration_s == pytest.approx(10.0)
    clock.now = 100.0
    assert live.report().num_requests == 0 and len(live) == 0


def test_live_window_by_count() -> None:
    clock = FakeClock()
    live = LiveSLOStats(window_s=None, max_records=2, clock=clock)
    for i in range(3):
        live.record(make(10, start_s=float(i)))
    clock.now = 4.0
    report = live.report()
    # The first record (ended at 0.01) was dropped, so the window starts there.
    assert report.num_requests == 2 and report.duration_s == pytest.approx(3.99)
    assert report.request_throughput == pytest.approx(2 / 3.99)


def test_live_concurrent_record() -> None:
    live = LiveSLOStats(window_s=None, max_records=1000)

    def feed() -> None:
        for _ in range(100):
            live.record(make(10))
            live.report()

    threads = [threading.Thread(target=feed) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(live) == 400


def test_live_requires_a_bound() -> None:
    with pytest.raises(ValueError):
        LiveSLOStats(window_s=None, max_records=None)
