"""Prometheus metrics, named as vLLM names them, under a ``plait:`` prefix.

Two sources. Latencies (TTFT, inter-token, end-to-end) are what a client sees, so the HTTP process
measures them per request into histograms. Everything the scheduler knows (queue lengths, KV use,
token and event counters) arrives with every output batch as a ``SchedulerSnapshot``; a custom
collector renders the latest one at scrape time, so the counters are the scheduler's own totals and
cannot drift from it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from plait.engine.messages import SchedulerSnapshot
from plait.scheduler.stats import BucketCounts

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets, which cover both CPU test runs and GPU serving.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0, 7680.0)


class _SchedulerCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self.metrics.snapshot or SchedulerSnapshot()
        gauges = [
            ("plait:num_requests_running", "Requests admitted by the scheduler (prefilling or decoding).",
             s.num_running),
            ("plait:num_requests_waiting", "Requests waiting for admission.", s.num_waiting),
            ("plait:kv_cache_usage_perc", "Fraction of KV slots held by live requests (1 = full).",
             s.kv_slots_in_use / s.max_total_tokens if s.max_total_tokens else 0.0),
            ("plait:kv_slots_in_use", "KV slots held by live requests (neither free nor evictable cache).",
             s.kv_slots_in_use),
            ("plait:kv_slots_total", "KV pool size in tokens.", s.max_total_tokens),
            ("plait:prefix_cache_evictable_tokens", "KV slots holding evictable prefix-cache entries.",
             s.evictable_tokens),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = [
            ("plait:prompt_tokens", "Prompt tokens admitted.", s.counters.prompt_tokens),
            ("plait:generation_tokens", "Tokens generated.", s.counters.generation_tokens),
            ("plait:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", s.counters.cached_tokens),
            ("plait:num_retractions", "Requests retracted (KV freed, requeued) for lack of KV.",
             s.counters.num_retractions),
            ("plait:num_aborted_requests", "Requests aborted (client disconnect, shutdown).", s.counters.num_aborts),
            ("plait:forward_steps", "Model forward steps.", s.counters.forward_steps),
            ("plait:grammar_compiles", "Grammars compiled (constrained decoding).", s.counters.grammar_compiles),
            ("plait:grammar_compile_failures", "Grammars that failed to compile.",
             s.counters.grammar_compile_failures),
            ("plait:grammar_cache_hits", "Constrained requests whose grammar was compiled (or compiling) already.",
             s.counters.grammar_cache_hits),
        ]
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield _histogram("plait:grammar_compile_time_seconds", "Time to compile one grammar.",
                         s.counters.grammar_compile_seconds, s.counters.grammar_compile_seconds_sum)


def _histogram(name: str, doc: str, h: BucketCounts, total: float) -> HistogramMetricFamily:
    """A Prometheus histogram (cumulative buckets) from the scheduler's per-bucket counts."""
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip(h.bounds, h.counts, strict=False):
        running += count
        buckets.append((repr(float(bound)), running))
    buckets.append(("+Inf", sum(h.counts)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


class ServerMetrics:
    def __init__(self) -> None:
        # A registry per server, not prometheus_client's global one: tests build several apps.
        self.registry = CollectorRegistry()
        self.snapshot: SchedulerSnapshot | None = None
        self.ttft = Histogram("plait:time_to_first_token_seconds", "Time to first token.",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("plait:inter_token_latency_seconds", "Time between output tokens.",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("plait:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.rejected = Counter("plait:num_rejected_requests", "Requests refused with 503 (queue full, "
                                "starting, shutting down).", registry=self.registry)
        self.registry.register(_SchedulerCollector(self))

    def render(self) -> bytes:
        return generate_latest(self.registry)
