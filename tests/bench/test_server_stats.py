"""bench.server_stats: speculative decoding over a run, from the router's real exposition."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pdserve_proto.nodes import NodeLoad

from bench.report import BenchRun, load_report, render_markdown, write_report
from bench.server_stats import SpecDecodeStats, parse_spec_counters
from bench.slo import LiveSLOStats, RequestRecord, SLOConfig, parse_slo, summarize
from router.metrics import RouterMetrics


def exposition(*loads: NodeLoad) -> str:
    named = [(f"d{i}", load) for i, load in enumerate(loads)]
    return RouterMetrics(dict, LiveSLOStats(parse_slo("")), lambda: named).exposition().decode()


def test_a_run_counts_the_difference_summed_over_instances() -> None:
    before = parse_spec_counters(
        exposition(
            NodeLoad(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=6)
        )
    )
    after = parse_spec_counters(
        exposition(
            NodeLoad(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=15),
            NodeLoad(spec_num_drafts=2, spec_num_draft_tokens=6, spec_num_accepted_tokens=0),
        )
    )
    run = after - before
    assert run == SpecDecodeStats(drafts=8, draft_tokens=24, accepted_tokens=9)
    assert run.acceptance_rate == 9 / 24
    assert run.mean_accepted_length == 1 + 9 / 8
    assert parse_spec_counters("") == SpecDecodeStats()  # a server without the counters
    assert SpecDecodeStats(1, 3, 2) - SpecDecodeStats(5, 9, 9) == SpecDecodeStats()  # restarts


def test_the_report_shows_and_keeps_it(tmp_path: Path) -> None:
    times = [0.01, 0.02, 0.03, 0.04]
    records = [RequestRecord(0.0, 0.01, times, 0.05, prompt_tokens=8, output_tokens=4)] * 3
    report = summarize(records, 1.0, SLOConfig())
    spec = SpecDecodeStats(drafts=8, draft_tokens=24, accepted_tokens=9)
    runs = [BenchRun(1.0, 1.0, report, records, spec)]
    write_report(tmp_path, {"model": "m"}, runs)
    loaded = load_report(tmp_path / "report.json")
    assert loaded["runs"][0].spec == spec
    text = render_markdown({"model": "m"}, runs, 0.9)
    assert "acceptance rate 37.5% (9 of 24 draft tokens)" in text
    assert "mean accepted length 2.12" in text
    no_spec = render_markdown({"model": "m"}, [dataclasses.replace(runs[0], spec=None)], 0.9)
    assert "Speculative" not in no_spec
