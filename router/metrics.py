"""Router measurements: Prometheus metrics and the live SLO window, fed by one meter per request.

TTFT, ITL and E2E are measured here, at the router, on ``time.perf_counter``: arrival is when
the front door accepted the request, a token *arrival* is when a delta carrying tokens leaves
the flow for the client (one arrival may carry several tokens). Every finished request is
counted by status; successful and failed ones go to ``LiveSLOStats`` (the ``/slo`` report),
requests the client abandoned do not (they are neither good nor bad service).

Metrics live in a registry owned by the ``RouterMetrics`` object, never the process-global one.

vLLM's names are exported beside pdserve's, with a ``model_name`` label, so a Grafana dashboard
built for vLLM reads the router unchanged: ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds`` (and its older name ``vllm:time_per_output_token_seconds``),
``vllm:e2e_request_latency_seconds`` (histograms, the same observations as pdserve's),
``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``, and the decode pool's engines
summed at scrape time: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (their mean; also as ``vllm:gpu_cache_usage_perc``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from pdserve_proto.nodes import NodeLoad
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bench.slo import LiveSLOStats, RequestRecord

_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _InstanceCollector(Collector):
    """``pdserve_router_instances{pool,state}``, read from the registry at scrape time."""

    def __init__(self, counts: Callable[[], dict[tuple[str, str], int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "pdserve_router_instances", "Instances known to the router", labels=["pool", "state"]
        )
        counts = self._counts()
        for pool in ("prefill", "decode"):
            family.add_metric([pool, "ready"], counts.get((pool, "ready"), 0))
        for (pool, state), count in sorted(counts.items()):
            if state != "ready":
                family.add_metric([pool, state], count)
        yield family


class _SpecDecodeCollector(Collector):
    """Speculative decoding on the decode nodes, read from their heartbeat loads at scrape
    time: each instance's counters (a restarted node starts again from 0, which Prometheus
    reads as a counter reset), and the pool's acceptance rate and mean accepted length over
    what the live instances have counted."""

    def __init__(self, loads: Callable[[], list[tuple[str, NodeLoad]]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        loads = self._loads()
        families = {
            "spec_num_drafts": "Verification runs with drafts (speculative decoding)",
            "spec_num_draft_tokens": "Draft tokens proposed",
            "spec_num_accepted_tokens": "Draft tokens accepted",
        }
        for field, doc in families.items():
            name = "pdserve_decode_" + field.removeprefix("spec_num_")
            family = CounterMetricFamily(name, doc, labels=["instance"])
            for instance, load in loads:
                family.add_metric([instance], getattr(load, field))
            yield family
        drafts = sum(load.spec_num_drafts for _, load in loads)
        proposed = sum(load.spec_num_draft_tokens for _, load in loads)
        accepted = sum(load.spec_num_accepted_tokens for _, load in loads)
        rate = GaugeMetricFamily(
            "pdserve_decode_spec_acceptance_rate", "Accepted / proposed draft tokens (pool)"
        )
        rate.add_metric([], accepted / proposed if proposed else 0.0)
        yield rate
        length = GaugeMetricFamily(
            "pdserve_decode_spec_mean_accepted_length",
            "Tokens emitted per verification run: 1 + accepted / drafts (pool)",
        )
        length.add_metric([], 1.0 + accepted / drafts if drafts else 0.0)
        yield length


class _VllmEngineCollector(Collector):
    """vLLM's engine gauges, from the decode pool's heartbeat loads at scrape time."""

    def __init__(self, loads: Callable[[], list[tuple[str, NodeLoad]]], model_name: str) -> None:
        self._loads, self._model = loads, model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        loads = [load for _, load in self._loads()]
        usage = sum(load.kv_usage for load in loads) / len(loads) if loads else 0.0
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests running (decode pool)",
             sum(load.num_running for load in loads)),
            ("vllm:num_requests_waiting", "Requests waiting (decode pool)",
             sum(load.num_waiting for load in loads)),
            ("vllm:kv_cache_usage_perc", "KV cache usage, 1 = full (decode pool mean)", usage),
            ("vllm:gpu_cache_usage_perc", "KV cache usage (vLLM's older name)", usage),
        ):  # fmt: skip
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family


class _VllmNames:
    """The request metrics under vLLM's names, observed with pdserve's own."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        def histogram(name: str, doc: str) -> Histogram:
            made = Histogram(
                name, doc, ["model_name"], buckets=_LATENCY_BUCKETS_S, registry=registry
            )
            return made.labels(model_name)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Inter-token latency")
        self.tpot = histogram("vllm:time_per_output_token_seconds", "Inter-token latency")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens", ["model_name"], registry=registry
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", ["model_name"], registry=registry
        ).labels(model_name)


class RouterMetrics:
    """Every metric the router exports, plus the live SLO window. ``model_name``: the served
    name, the ``model_name`` label of vLLM's names."""

    def __init__(
        self,
        instance_counts: Callable[[], dict[tuple[str, str], int]],
        slo: LiveSLOStats,
        decode_loads: Callable[[], list[tuple[str, NodeLoad]]] = list,
        model_name: str = "",
    ) -> None:
        self.registry = CollectorRegistry()
        self.slo = slo
        r = self.registry
        self.vllm = _VllmNames(r, model_name)
        self.requests = Counter(
            "pdserve_router_requests", "Finished requests", ["endpoint", "status"], registry=r
        )
        self.inflight = Gauge("pdserve_router_inflight_requests", "Requests in flight", registry=r)
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            "pdserve_router_itl_seconds",
            "Inter-token latency",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_router_e2e_seconds",
            "End-to-end latency",
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "Prompt tokens", registry=r)
        self.output_tokens = Counter("pdserve_router_output_tokens", "Output tokens", registry=r)
        self.retries = Counter(
            "pdserve_router_prefill_retries", "Prefills retried on another instance", registry=r
        )
        self.migrations = Counter(
            "pdserve_router_decode_migrations", "Decodes resumed on another instance", registry=r
        )
        self.prefill_fallbacks = Counter(
            "pdserve_router_prefill_fallbacks",
            "Samples run whole on a decode node (reason: no_prefill = no healthy prefill"
            " instance, prefill_failed = every prefill attempt failed before a first token)",
            ["reason"],
            registry=r,
        )
        self.registry.register(_InstanceCollector(instance_counts))
        self.registry.register(_SpecDecodeCollector(decode_loads))
        self.registry.register(_VllmEngineCollector(decode_loads, model_name))

    def exposition(self) -> bytes:
        """The Prometheus text format of every metric."""
        return generate_latest(self.registry)

    def start(self, endpoint: str) -> RequestMeter:
        return RequestMeter(self, endpoint)

    def prefill_fallback(self, reason: str) -> None:
        """Count a sample that fell back to a decode-only run."""
        self.prefill_fallbacks.labels(reason).inc()

    def rejected(self, endpoint: str, status: str) -> None:
        """Count a request refused before it ran (bad input, unknown model)."""
        self.requests.labels(endpoint, status).inc()


class RequestMeter:
    """Timeline of one request; call ``tokens`` per delta and ``finish`` exactly once."""

    def __init__(self, metrics: RouterMetrics, endpoint: str) -> None:
        self._metrics = metrics
        self._endpoint = endpoint
        self.start_s = time.perf_counter()
        self.token_times_s: list[float] = []
        self._finished = False
        metrics.inflight.inc()

    def tokens(self, count: int) -> None:
        """A delta with ``count`` tokens is leaving for the client now."""
        if count <= 0:
            return
        now = time.perf_counter()
        m = self._metrics
        if self.token_times_s:
            gap = now - self.token_times_s[-1]
            m.itl.observe(gap)
            m.vllm.itl.observe(gap)
            m.vllm.tpot.observe(gap)
        else:
            m.ttft.observe(now - self.start_s)
            m.vllm.ttft.observe(now - self.start_s)
        self.token_times_s.append(now)

    def finish(
        self,
        status: str,
        prompt_tokens: int,
        output_tokens: int,
        retries: int = 0,
        migrations: int = 0,
    ) -> None:
        """Record the outcome: ``ok``, ``aborted`` (client gone) or an error kind."""
        if self._finished:
            return
        self._finished = True
        m = self._metrics
        m.inflight.dec()
        m.requests.labels(self._endpoint, status).inc()
        m.retries.inc(retries)
        m.migrations.inc(migrations)
        end_s = time.perf_counter()
        if status == "ok":
            m.e2e.observe(end_s - self.start_s)
            m.prompt_tokens.inc(prompt_tokens)
            m.output_tokens.inc(output_tokens)
            m.vllm.e2e.observe(end_s - self.start_s)
            m.vllm.prompt_tokens.inc(prompt_tokens)
            m.vllm.generation_tokens.inc(output_tokens)
        if status == "aborted" or (status == "ok" and not self.token_times_s):
            return
        ok = status == "ok"
        m.slo.record(
            RequestRecord(
                start_s=self.start_s,
                first_token_s=self.token_times_s[0] if self.token_times_s else None,
                token_times_s=self.token_times_s,
                end_s=end_s,
                prompt_tokens=prompt_tokens,
                output_tokens=max(output_tokens, 1) if ok else output_tokens,
                success=ok,
                error=None if ok else status,
            )
        )
