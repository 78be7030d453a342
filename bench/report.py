"""What ``pdserve bench`` writes: report.json, report.md, records.jsonl and PNG plots.

``report.json`` (schema ``pdserve.bench_report/v1``) holds the run configuration and one
SLOReport per rate; ``records.jsonl`` every request's raw timestamps, so any number can be
recomputed with ``bench.slo.summarize``. Plots use matplotlib's object API (``Figure``, the Agg
canvas) rather than pyplot, so writing a report touches no global plotting state.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from bench.server_stats import SpecDecodeStats
from bench.slo import METRICS, RequestRecord, SLOConfig, SLOReport

if TYPE_CHECKING:  # matplotlib loads only to draw: `pdserve bench --help` stays light
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

SCHEMA = "pdserve.bench_report/v1"
_LABELS = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL", "e2e": "E2E latency"}


@dataclass(frozen=True)
class BenchRun:
    """One load level: offered ``rate`` (req/s, may be inf), its summary and its raw records."""

    rate: float
    burstiness: float
    report: SLOReport
    records: list[RequestRecord] = field(default_factory=list)
    spec: SpecDecodeStats | None = None  # the server's speculative decoding, when it speculated


class SweepLimit(NamedTuple):
    """Where a sweep puts the SLO limit: between ``best``, the highest rate meeting the target
    with every lower rate meeting it too (so one lucky run past the knee does not count; None:
    not even the lowest did), and ``first_missing``, the lowest rate that missed it (None: every
    swept rate met it, so the limit lies above them all and was not found)."""

    best: float | None
    first_missing: float | None

    @property
    def found(self) -> bool:
        return self.best is not None and self.first_missing is not None


# A run's honesty checks: under MIN_RUN_S of arrivals no queue can build, so a rate the server
# cannot sustain still looks met; completions slower than ACHIEVED_FLOOR of the arrivals mean
# the server fell behind (its latencies only grow with a longer run); token gaps under
# STARVED_GAP_MS for STARVED_SHARE of them mean the client read events in bursts.
MIN_RUN_S = 20.0
ACHIEVED_FLOOR = 0.9
STARVED_GAP_MS = 0.05
STARVED_SHARE = 0.2


class Pace(NamedTuple):
    """How fast requests were sent and completed (req/s over each span; None: too few)."""

    sent: float | None
    achieved: float | None
    span_s: float  # from the first send to the last


def pace(records: Sequence[RequestRecord]) -> Pace:
    starts = sorted(r.start_s for r in records)
    ends = sorted(r.end_s for r in records if r.success)

    def rate(times: list[float]) -> float | None:
        span = times[-1] - times[0] if len(times) > 1 else 0.0
        return (len(times) - 1) / span if span > 0 else None

    return Pace(rate(starts), rate(ends), starts[-1] - starts[0] if starts else 0.0)


MIN_PACED = 10  # fewer requests cannot tell a slow server from one slow request


def fell_behind(run: BenchRun) -> bool:
    """Completions came slower than ``ACHIEVED_FLOOR`` of the arrivals (finite rates)."""
    p = pace(run.records)
    if not math.isfinite(run.rate) or len(run.records) < MIN_PACED:
        return False
    if p.sent is None or p.achieved is None:
        return False
    return p.achieved < ACHIEVED_FLOOR * p.sent


def too_short(run: BenchRun) -> bool:
    return math.isfinite(run.rate) and bool(run.records) and pace(run.records).span_s < MIN_RUN_S


def run_warnings(run: BenchRun) -> list[str]:
    """What makes this run's figures untrustworthy, one sentence each."""
    out, p = [], pace(run.records)
    if fell_behind(run):
        out.append(
            f"achieved {p.achieved:.2f} req/s of {p.sent:.2f} sent: the server fell behind"
            " (a queue grew; a longer run would look worse)"
        )
    if too_short(run):
        out.append(
            f"arrivals spanned {p.span_s:.0f} s, under {MIN_RUN_S:.0f} s: too short for a"
            " queue to build (--duration 60, or more prompts)"
        )
    gaps = _samples_ms(run.records, "itl")
    starved = float(np.mean(gaps < STARVED_GAP_MS)) if gaps.size >= 50 else 0.0
    if starved >= STARVED_SHARE:
        out.append(
            f"{starved:.0%} of token gaps under {STARVED_GAP_MS * 1e3:.0f} us: the client read"
            " events in bursts (its machine is overloaded): ITL and TPOT are understated"
        )
    return out


def sweep_limit(runs: Sequence[BenchRun], target: float) -> SweepLimit:
    """Scan the runs by rate for the first that misses: SLO attainment below ``target``, or
    completions that fell behind the arrivals (the SLOs were met only because the run ended)."""
    best = None
    for run in sorted(runs, key=lambda r: r.rate):
        if run.report.overall_attainment < target or fell_behind(run):
            return SweepLimit(best, run.rate)
        best = run.rate
    return SweepLimit(best, None)


def max_rate_meeting_slo(runs: Sequence[BenchRun], target: float) -> float | None:
    """Highest swept rate meeting ``target`` with every lower rate meeting it too; None if the
    lowest fails. Whether it is the limit: :func:`sweep_limit`."""
    return sweep_limit(runs, target).best


def sweep_verdict(runs: Sequence[BenchRun], target: float) -> str:
    """One sentence on the SLO limit of a sweep, honest about a limit it did not reach."""
    limit = sweep_limit(runs, target)
    met = f"≥ {target:.0%} of requests meeting every SLO"
    if runs and not runs[0].report.slo.bounds():
        return "No SLO given (--slo, --goodput): every rate meets it, there is no limit to find."
    short = [r for r in runs if too_short(r)]
    if short:
        shortest = min(pace(r.records).span_s for r in short)
        return (
            f"Not found: runs whose arrivals span under {MIN_RUN_S:.0f} s (the shortest"
            f" {shortest:.0f} s) cannot build a queue, so no limit can be read from them"
            " (--duration 60, or more prompts)."
        )
    if limit.best is None:
        lowest = _rate_text(min(r.rate for r in runs))
        return f"Not found: no swept rate had {met}; the limit lies below {lowest} req/s."
    if limit.first_missing is None:
        if math.isinf(limit.best):
            return f"Not found: every swept rate had {met}, even all requests at once (inf)."
        return (
            f"Not found: every swept rate had {met}; the limit lies above "
            f"{_rate_text(limit.best)} req/s (sweep higher rates)."
        )
    return (
        f"Highest rate with {met}: **{_rate_text(limit.best)} req/s** "
        f"({_rate_text(limit.first_missing)} req/s missed it)."
    )


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# --------------------------------------------------------------------------- JSON


def report_dict(config: dict[str, Any], runs: Sequence[BenchRun], target: float) -> dict[str, Any]:
    """The JSON document of a benchmark (rates as numbers, ``"inf"`` for unlimited)."""
    limit = sweep_limit(runs, target)
    return {
        "schema": SCHEMA,
        "config": config,
        "attainment_target": target,
        # the highest rate meeting the target; the limit only when slo_limit_found is true
        "max_rate_meeting_slo": None if limit.best is None else _rate_json(limit.best),
        "first_rate_missing_slo": (
            None if limit.first_missing is None else _rate_json(limit.first_missing)
        ),
        "slo_limit_found": limit.found,
        "runs": [
            {
                "rate": _rate_json(r.rate),
                "burstiness": r.burstiness,
                "report": r.report.to_dict(),
                "speculative_decoding": None if r.spec is None else r.spec.to_dict(),
            }
            for r in runs
        ],
    }


def _spec_of(saved: dict[str, Any] | None) -> SpecDecodeStats | None:
    if not saved:
        return None
    return SpecDecodeStats(saved["drafts"], saved["draft_tokens"], saved["accepted_tokens"])


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no Infinity


def load_report(path: Path) -> dict[str, Any]:
    """Read a report.json; runs come back as BenchRun (without records) under ``"runs"``."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise ValueError(f"{path} is not a pdserve bench report (schema {data.get('schema')!r})")
    data["runs"] = [
        BenchRun(
            float(r["rate"]),
            r["burstiness"],
            SLOReport.from_dict(r["report"]),
            spec=_spec_of(r.get("speculative_decoding")),
        )
        for r in data["runs"]
    ]
    return data


# --------------------------------------------------------------------------- Markdown


def _ms(stats: Any, attr: str) -> str:
    return "-" if stats is None else f"{getattr(stats, attr):.1f}"


def _sweep_table(runs: Sequence[BenchRun]) -> list[str]:
    lines = [
        "| offered (req/s) | sent | achieved | goodput | SLO met | TTFT p50 | TTFT p99 | TPOT p50 "
        "| TPOT p99 | ITL p99 | E2E p50 | failed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for run in runs:
        r, p = run.report, pace(run.records)
        flag = " ⚠" if run_warnings(run) else ""
        lines.append(
            f"| {_rate_text(run.rate)}{flag} | {_num(p.sent)} | {_num(p.achieved)} | "
            f"{r.goodput:.2f} | "
            f"{r.overall_attainment:.1%} | {_ms(r.ttft, 'median_ms')} | {_ms(r.ttft, 'p99_ms')} | "
            f"{_ms(r.tpot, 'median_ms')} | {_ms(r.tpot, 'p99_ms')} | {_ms(r.itl, 'p99_ms')} | "
            f"{_ms(r.e2e, 'median_ms')} | {r.num_failed} |"
        )
    return lines


def render_markdown(
    config: dict[str, Any], runs: Sequence[BenchRun], target: float, plots: Sequence[str] = ()
) -> str:
    """The Markdown report: configuration, sweep summary (several rates), one section per run."""
    lines = ["# pdserve bench", "", "| setting | value |", "| --- | --- |"]
    lines += [f"| {key} | {value} |" for key, value in config.items() if value is not None]
    if len(runs) > 1:
        lines += ["", "## Sweep", "", *_sweep_table(runs), "", sweep_verdict(runs, target)]
    for run in runs:
        lines += ["", f"## Rate {_rate_text(run.rate)} req/s", "", run.report.to_markdown()]
        lines += [f"\n**Warning:** {warning}" for warning in run_warnings(run)]
        if run.spec is not None:
            lines += ["", _spec_line(run.spec)]
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(lines) + "\n"


def _spec_line(spec: SpecDecodeStats) -> str:
    return (
        f"Speculative decoding: acceptance rate {spec.acceptance_rate:.1%} "
        f"({spec.accepted_tokens} of {spec.draft_tokens} draft tokens), mean accepted length "
        f"{spec.mean_accepted_length:.2f} tokens per verification ({spec.drafts} runs)."
    )


def _compared_rows() -> list[tuple[str, Callable[[SLOReport], float | None]]]:
    """(row name, getter) of the comparison table: throughputs, then latency percentiles."""
    rows: list[tuple[str, Callable[[SLOReport], float | None]]] = [
        ("request throughput (req/s)", lambda r: r.request_throughput),
        ("goodput (req/s)", lambda r: r.goodput),
        ("SLO attainment", lambda r: r.overall_attainment),
        ("output tokens/s", lambda r: r.output_throughput),
        ("failed", lambda r: r.num_failed),
    ]
    stats = (("mean", "mean_ms"), ("p50", "median_ms"), ("p90", "p90_ms"), ("p99", "p99_ms"))
    for metric in METRICS:
        for name, attr in stats:
            rows.append((f"{metric.upper()} {name} (ms)", partial(_stat, metric=metric, attr=attr)))
    return rows


def _stat(report: SLOReport, metric: str, attr: str) -> float | None:
    stats = report.latency(metric)
    return None if stats is None else getattr(stats, attr)


def _pairs(a: list[BenchRun], b: list[BenchRun]) -> list[tuple[BenchRun, BenchRun]]:
    """Runs at the same rate; the first of each when they share no rate."""
    by_rate = {run.rate: run for run in b}
    pairs = [(run, by_rate[run.rate]) for run in a if run.rate in by_rate]
    return pairs or [(a[0], b[0])]


def compare_markdown(a: dict[str, Any], b: dict[str, Any], label_a: str, label_b: str) -> str:
    """Side-by-side table of two loaded reports (``load_report``), one table per shared rate."""
    lines = [f"# pdserve bench: {label_a} vs {label_b}", ""]
    for run_a, run_b in _pairs(a["runs"], b["runs"]):
        lines += [f"## rate {_rate_text(run_a.rate)} vs {_rate_text(run_b.rate)} req/s", ""]
        lines += [f"| metric | {label_a} | {label_b} | change |", "| --- | ---: | ---: | ---: |"]
        for name, get in _compared_rows():
            va, vb = get(run_a.report), get(run_b.report)
            lines.append(f"| {name} | {_num(va)} | {_num(vb)} | {_change(va, vb)} |")
        lines.append("")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"


def _change(a: float | None, b: float | None) -> str:
    if a is None or b is None or a == 0:
        return "-"
    return f"{(b - a) / abs(a):+.1%}"


# --------------------------------------------------------------------------- plots


def _samples_ms(records: Sequence[RequestRecord], metric: str) -> np.ndarray:
    """The values summarize() uses for ``metric``, in ms: successful requests only."""
    ok = [r for r in records if r.success]
    if metric == "itl":
        return np.concatenate([r.itls_s for r in ok] or [np.empty(0)]) * 1e3
    values = [getattr(r, f"{metric}_s") for r in ok]
    return np.array([v for v in values if v is not None], dtype=np.float64) * 1e3


def _figure(**kwargs: Any) -> Figure:
    from matplotlib.figure import Figure

    return Figure(**kwargs)


def _slo_line(ax: Axes, bound: float | None, vertical: bool) -> None:
    if bound is not None:
        draw = ax.axvline if vertical else ax.axhline
        draw(bound, color="crimson", linestyle="--", linewidth=1.2, label=f"SLO {bound:g} ms")


def plot_latency_cdfs(runs: Sequence[BenchRun], slo: SLOConfig, path: Path) -> None:
    """2x2 empirical CDFs of TTFT, TPOT, ITL and E2E, one curve per run, SLO bounds dashed."""
    fig = _figure(figsize=(12, 8), layout="constrained")
    colors = _colors(len(runs))
    for ax, metric in zip(fig.subplots(2, 2).flat, METRICS, strict=True):
        positive = False
        for run, color in zip(runs, colors, strict=True):
            values = np.sort(_samples_ms(run.records, metric))
            positive = positive or bool(values.size and values[-1] > 0)
            if values.size:
                y = np.arange(1, values.size + 1) / values.size
                ax.step(values, y, where="post", color=color, label=f"{_rate_text(run.rate)} req/s")
        _slo_line(ax, slo.bounds().get(metric), vertical=True)
        unit = "token gaps" if metric == "itl" else "requests"
        ax.set(
            title=f"{_LABELS[metric]} CDF",
            xlabel=f"{_LABELS[metric]} (ms, log scale)",
            ylabel=f"fraction of {unit}",
            ylim=(0, 1.02),
        )
        if positive:  # a log axis: one long gap no longer squashes the rest into a pixel
            ax.set_xscale("log")
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(loc="lower right", fontsize="small")
    fig.suptitle("Latency distributions")
    fig.savefig(path, dpi=110)


def _colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    return [colormaps["viridis"](x) for x in np.linspace(0.0, 0.85, max(n, 1))][:n]


def _mark_best(ax: Axes, limit: SweepLimit, target: float) -> None:
    if limit.best is not None:
        label = (
            f"limit: {limit.best:g} req/s (≥{target:.0%} met)"
            if limit.found
            else f"≥{target:.0%} met up to {limit.best:g} req/s (no limit found)"
        )
        ax.axvline(limit.best, color="dimgray", linestyle="-.", linewidth=1.2, label=label)


def plot_sweep_latency(runs: Sequence[BenchRun], slo: SLOConfig, target: float, path: Path) -> None:
    """2x2: p50/p90/p99 of each metric against offered rate (finite rates only)."""
    runs = sorted((r for r in runs if math.isfinite(r.rate)), key=lambda r: r.rate)
    rates = [r.rate for r in runs]
    limit = sweep_limit(runs, target)
    fig = _figure(figsize=(12, 8), layout="constrained")
    for ax, metric in zip(fig.subplots(2, 2).flat, METRICS, strict=True):
        for attr, style in (("median_ms", "-o"), ("p90_ms", "--s"), ("p99_ms", ":^")):
            ys = [_stat(r.report, metric, attr) for r in runs]
            ys_plot = [np.nan if y is None else y for y in ys]
            ax.plot(rates, ys_plot, style, label=attr.removesuffix("_ms").replace("median", "p50"))
        _slo_line(ax, slo.bounds().get(metric), vertical=False)
        _mark_best(ax, limit, target)
        ax.set(
            title=f"{_LABELS[metric]} vs load",
            xlabel="offered rate (req/s)",
            ylabel=f"{_LABELS[metric]} (ms)",
        )
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle("Latency percentiles across the sweep")
    fig.savefig(path, dpi=110)


def plot_sweep_goodput(runs: Sequence[BenchRun], target: float, path: Path) -> None:
    """Throughput and goodput (left axis) and SLO attainment (right axis) against offered rate."""
    runs = sorted((r for r in runs if math.isfinite(r.rate)), key=lambda r: r.rate)
    rates = np.array([r.rate for r in runs])
    fig = _figure(figsize=(9, 6), layout="constrained")
    ax = fig.subplots()
    ax.plot(rates, rates, color="grey", linewidth=0.8, linestyle="--", label="offered load")
    throughput = [r.report.request_throughput for r in runs]
    ax.plot(rates, throughput, "-o", color="tab:blue", label="throughput")
    goodput = [r.report.goodput for r in runs]
    ax.plot(rates, goodput, "-s", color="tab:green", label="goodput (all SLOs met)")
    _mark_best(ax, sweep_limit(runs, target), target)
    ax.set(xlabel="offered rate (req/s)", ylabel="requests/s", title="Goodput vs offered load")
    ax.grid(True, alpha=0.3)
    right = ax.twinx()
    attainment = [100 * r.report.overall_attainment for r in runs]
    right.plot(rates, attainment, "-^", color="tab:orange", label="SLO attainment (right axis)")
    right.axhline(100 * target, color="tab:orange", linestyle=":", label=f"{target:.0%} target")
    right.set(ylabel="requests meeting every SLO (%)", ylim=(0, 105))
    # One legend for both axes, outside the plot so that it hides no curve.
    handles, labels = ax.get_legend_handles_labels()
    more_handles, more_labels = right.get_legend_handles_labels()
    fig.legend(
        handles + more_handles,
        labels + more_labels,
        loc="outside lower center",
        ncols=3,
        fontsize="small",
    )
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- files


def _write_records(path: Path, runs: Sequence[BenchRun]) -> None:
    with path.open("w") as f:
        for index, run in enumerate(runs):
            for record in run.records:
                row = {"run": index, "rate": _rate_json(run.rate), **record.to_dict()}
                f.write(json.dumps(row, allow_nan=False) + "\n")


def write_report(
    out_dir: Path, config: dict[str, Any], runs: Sequence[BenchRun], target: float = 0.9
) -> list[Path]:
    """Write report.json, records.jsonl, the PNG plots and report.md into ``out_dir``
    (created if missing; existing files of the same names are replaced). Returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    slo = runs[0].report.slo if runs else SLOConfig()
    plots = [out_dir / "latency_cdf.png"]
    plot_latency_cdfs(runs, slo, plots[0])
    if sum(math.isfinite(r.rate) for r in runs) > 1:
        plots += [out_dir / "sweep_latency.png", out_dir / "sweep_goodput.png"]
        plot_sweep_latency(runs, slo, target, plots[1])
        plot_sweep_goodput(runs, target, plots[2])
    report_json = out_dir / "report.json"
    document = report_dict(config, runs, target)
    report_json.write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")
    records = out_dir / "records.jsonl"
    _write_records(records, runs)
    markdown = out_dir / "report.md"
    markdown.write_text(render_markdown(config, runs, target, [p.name for p in plots]))
    return [report_json, markdown, records, *plots]
