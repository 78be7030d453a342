"""The router's Prometheus exposition: speculative decoding counters from the decode loads."""

from __future__ import annotations

from pdserve_proto.nodes import NodeLoad
from prometheus_client.parser import text_string_to_metric_families

from bench.slo import LiveSLOStats, parse_slo
from router.metrics import RouterMetrics


def scrape(metrics: RouterMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_speculative_decoding_counters_and_pool_rates() -> None:
    loads = [
        ("d0", NodeLoad(spec_num_drafts=10, spec_num_draft_tokens=30, spec_num_accepted_tokens=12)),
        ("d1", NodeLoad(spec_num_drafts=5, spec_num_draft_tokens=15, spec_num_accepted_tokens=3)),
    ]
    metrics = RouterMetrics(dict, LiveSLOStats(parse_slo("")), lambda: loads)
    got = scrape(metrics)
    assert got[("pdserve_decode_draft_tokens_total", (("instance", "d0"),))] == 30
    assert got[("pdserve_decode_accepted_tokens_total", (("instance", "d1"),))] == 3
    assert got[("pdserve_decode_drafts_total", (("instance", "d1"),))] == 5
    assert got[("pdserve_decode_spec_acceptance_rate", ())] == 15 / 45
    assert got[("pdserve_decode_spec_mean_accepted_length", ())] == 1 + 15 / 15


def test_no_speculation_reads_zero() -> None:
    metrics = RouterMetrics(dict, LiveSLOStats(parse_slo("")), lambda: [("d0", NodeLoad())])
    got = scrape(metrics)
    assert got[("pdserve_decode_spec_acceptance_rate", ())] == 0
    assert got[("pdserve_decode_draft_tokens_total", (("instance", "d0"),))] == 0


def test_vllm_names_beside_pdserves() -> None:
    """A Grafana dashboard built for vLLM finds its series: the same observations under vLLM's
    names with a model_name label, and the decode pool's engine gauges."""
    loads = [
        ("d0", NodeLoad(num_running=3, num_waiting=1, kv_usage=0.5)),
        ("d1", NodeLoad(num_running=2, num_waiting=4, kv_usage=0.25)),
    ]
    metrics = RouterMetrics(dict, LiveSLOStats(parse_slo("")), lambda: loads, model_name="m")
    meter = metrics.start("completions")
    meter.tokens(1)
    meter.tokens(2)
    meter.finish("ok", prompt_tokens=7, output_tokens=3)
    got = scrape(metrics)
    model = (("model_name", "m"),)
    assert got[("vllm:num_requests_running", model)] == 5
    assert got[("vllm:num_requests_waiting", model)] == 5
    assert got[("vllm:kv_cache_usage_perc", model)] == 0.375
    assert got[("vllm:prompt_tokens_total", model)] == 7
    assert got[("vllm:generation_tokens_total", model)] == 3
    for name, count in (
        ("vllm:time_to_first_token_seconds", 1),
        ("vllm:inter_token_latency_seconds", 1),
        ("vllm:time_per_output_token_seconds", 1),
        ("vllm:e2e_request_latency_seconds", 1),
    ):
        assert got[(f"{name}_count", model)] == count, name
    assert got[("pdserve_router_ttft_seconds_count", ())] == 1  # pdserve's own stay
