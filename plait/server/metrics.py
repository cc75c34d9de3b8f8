"""Prometheus metrics, named as vLLM names them, under a ``plait:`` prefix, each labelled with
``model_name``; with ``--sglang-metrics`` also under SGLang's names (``sglang:num_running_reqs``, ...),
so dashboards built for SGLang work unchanged.

Two sources. Latencies (TTFT, inter-token, end-to-end) are what a client sees, so the HTTP process
measures them per request into histograms. Everything the scheduler knows (queue lengths, KV use,
token and event counters) arrives with every output batch as a ``SchedulerSnapshot``; a custom
collector renders the latest one at scrape time, so the counters are the scheduler's own totals and
cannot drift from it.

Under several HTTP processes (``--tokenizer-worker-num``) each writes its own histograms and 503 count
to a file in their shared directory every ``SHARE_INTERVAL_S`` (``ServerMetrics.share``), and a scrape
adds the others' latest files to its own: whichever process answers, the totals cover every request.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
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


# The gauge gen_throughput averages generated tokens over this trailing window.
THROUGHPUT_WINDOW_S = 5.0
# Seconds between an HTTP process's writes of its own series for the others' scrapes (several processes).
SHARE_INTERVAL_S = 0.5
MODEL_LABEL = ("model_name",)


class _SchedulerCollector(Collector):
    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        s = self.metrics.snapshot or SchedulerSnapshot()
        c = s.counters
        usage = s.kv_slots_in_use / s.max_total_tokens if s.max_total_tokens else 0.0
        # Prompt tokens of first admissions are the prefix cache's queries; its matches the hits.
        hit_rate = c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0
        gauges = [
            ("plait:num_requests_running", "Requests admitted by the scheduler (prefilling or decoding).",
             s.num_running),
            ("plait:num_requests_waiting", "Requests waiting for admission.", s.num_waiting),
            ("plait:kv_cache_usage_perc", "Fraction of KV slots held by live requests (1 = full).", usage),
            ("plait:kv_slots_in_use", "KV slots held by live requests (neither free nor evictable cache).",
             s.kv_slots_in_use),
            ("plait:kv_slots_total", "KV pool size in tokens.", s.max_total_tokens),
            ("plait:prefix_cache_evictable_tokens", "KV slots holding evictable prefix-cache entries.",
             s.evictable_tokens),
            ("plait:prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start.", hit_rate),
        ]
        counters = [
            ("plait:prompt_tokens", "Prompt tokens admitted.", c.prompt_tokens),
            ("plait:generation_tokens", "Tokens generated.", c.generation_tokens),
            ("plait:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", c.prompt_tokens),
            ("plait:prefix_cache_hits", "Prompt tokens found in the prefix cache.", c.cached_tokens),
            ("plait:prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", c.cached_tokens),
            ("plait:num_retractions", "Requests retracted (KV freed, requeued) for lack of KV.", c.num_retractions),
            ("plait:num_aborted_requests", "Requests aborted (client disconnect, shutdown).", c.num_aborts),
            ("plait:forward_steps", "Model forward steps.", c.forward_steps),
            ("plait:grammar_compiles", "Grammars compiled (constrained decoding).", c.grammar_compiles),
            ("plait:grammar_compile_failures", "Grammars that failed to compile.", c.grammar_compile_failures),
            ("plait:grammar_cache_hits", "Constrained requests whose grammar was compiled (or compiling) already.",
             c.grammar_cache_hits),
            ("plait:scheduler_loop_iterations", "Scheduler-process loop iterations that stepped the scheduler.",
             s.loop.iterations),
            ("plait:scheduler_loop_recv_seconds", "Scheduler-process loop: taking and handling requests (busy).",
             s.loop.recv_s),
            ("plait:scheduler_loop_step_seconds", "Scheduler-process loop: scheduler steps (with the wait for the "
             "forward in flight).", s.loop.step_s),
            ("plait:scheduler_loop_collect_seconds", "Scheduler-process loop: building updates (detokenization).",
             s.loop.collect_s),
            ("plait:scheduler_loop_send_seconds", "Scheduler-process loop: sending updates (pickling, ZMQ).",
             s.loop.send_s),
            ("plait:scheduler_loop_prefill_iterations", "Scheduler-process loop iterations whose step began with "
             "requests waiting or in prefill.", s.loop.prefill_iterations),
            ("plait:scheduler_loop_prefill_step_seconds", "Scheduler-process loop: the steps of those iterations.",
             s.loop.prefill_step_s),
        ]
        if self.metrics.sglang_names:
            gauges += [
                ("sglang:num_running_reqs", "The number of running requests.", s.num_running),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", s.num_waiting),
                ("sglang:num_used_tokens", "The number of used tokens.", s.kv_slots_in_use),
                ("sglang:token_usage", "The token usage.", usage),
                ("sglang:cache_hit_rate", "The prefix cache hit rate.", hit_rate),
                ("sglang:gen_throughput", "The generation throughput (token/s).", self.metrics.gen_throughput()),
            ]
            counters += [
                ("sglang:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens),
                ("sglang:generation_tokens", "Number of generation tokens processed.", c.generation_tokens),
                ("sglang:cached_tokens", "Number of cached prompt tokens.", c.cached_tokens),
                ("sglang:num_aborted_requests", "Number of requests aborted.", c.num_aborts),
                ("sglang:num_retracted_reqs", "Number of retracted requests.", c.num_retractions),
            ]
        labels = [self.metrics.model_name]
        for name, doc, value in gauges:
            family = GaugeMetricFamily(name, doc, labels=MODEL_LABEL)
            family.add_metric(labels, value)
            yield family
        for name, doc, value in counters:
            counter = CounterMetricFamily(name, doc, labels=MODEL_LABEL)
            counter.add_metric(labels, value)
            yield counter
        yield _histogram("plait:grammar_compile_time_seconds", "Time to compile one grammar.",
                         c.grammar_compile_seconds, c.grammar_compile_seconds_sum, labels)


def _histogram(name: str, doc: str, h: BucketCounts, total: float, labels: list[str]) -> HistogramMetricFamily:
    """A Prometheus histogram (cumulative buckets) from the scheduler's per-bucket counts, with the
    ``model_name`` label every sample carries."""
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip(h.bounds, h.counts, strict=False):
        running += count
        buckets.append((repr(float(bound)), running))
    buckets.append(("+Inf", sum(h.counts)))
    family = HistogramMetricFamily(name, doc, labels=MODEL_LABEL)
    family.add_metric(labels, buckets, sum_value=total)
    return family


class _Histograms(Collector):
    """One latency histogram, exported as plait's name and, with SGLang's names on, SGLang's too.
    Plain counts rather than prometheus_client's Histogram: ``observe`` takes a count, so the k
    tokens of one merged event cost one update rather than k (the HTTP process does this per
    streamed token)."""

    def __init__(self, names: list[str], doc: str, bounds: tuple[float, ...], model_name: str) -> None:
        self.names, self.doc, self.bounds, self.model_name = names, doc, bounds, model_name
        self.counts = [0] * (len(bounds) + 1)  # counts[i]: observations <= bounds[i]; the last: above all
        self.sum = 0.0
        self.peers: tuple[list[int], float] = ([0] * (len(bounds) + 1), 0.0)  # the other HTTP processes'

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def collect(self) -> Iterator[Metric]:
        peer_counts, peer_sum = self.peers
        counts = BucketCounts(self.bounds, tuple(a + b for a, b in zip(self.counts, peer_counts, strict=True)))
        for name in self.names:
            yield _histogram(name, self.doc, counts, self.sum + peer_sum, [self.model_name])


class _Count(Collector):
    """A counter this process increments, plus the other HTTP processes' (``peers``)."""

    def __init__(self, name: str, doc: str, model_name: str) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.value = 0
        self.peers = 0

    def inc(self, n: int = 1) -> None:
        self.value += n

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=MODEL_LABEL)
        family.add_metric([self.model_name], self.value + self.peers)
        yield family


class ServerMetrics:
    """Every sample carries ``model_name`` (the served model name), as in SGLang and vLLM."""

    def __init__(self, model_name: str = "", sglang_names: bool = False) -> None:
        # A registry per server, not prometheus_client's global one: tests build several apps.
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.sglang_names = sglang_names
        self._snapshot: SchedulerSnapshot | None = None
        # (monotonic time, generation tokens so far) per snapshot, for gen_throughput.
        self._generated: deque[tuple[float, int]] = deque()

        def histogram(name: str, doc: str, buckets: tuple[float, ...], sglang: str) -> _Histograms:
            hist = _Histograms([name] + ([sglang] if sglang_names else []), doc, buckets, model_name)
            self.registry.register(hist)
            return hist

        self.ttft = histogram("plait:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS,
                              "sglang:time_to_first_token_seconds")
        self.itl = histogram("plait:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS,
                             "sglang:inter_token_latency_seconds")
        self.e2e = histogram("plait:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                             _E2E_BUCKETS, "sglang:e2e_request_latency_seconds")
        self.rejected = _Count("plait:num_rejected_requests", "Requests refused with 503 (queue full, "
                               "starting, shutting down).", model_name)
        self.registry.register(self.rejected)
        self.registry.register(_SchedulerCollector(self))
        self._share: tuple[pathlib.Path, int] | None = None  # (directory, this process's index)

    def share(self, directory: str, worker: int) -> None:
        """Exchange this process's own series with the other HTTP processes through ``directory``."""
        self._share = (pathlib.Path(directory), worker)

    def write_share(self) -> None:
        """This process's own series into its file (atomically: a reader sees the old or the new)."""
        if self._share is None:
            return
        directory, worker = self._share
        state = {"hist": {h.names[0]: [h.counts, h.sum] for h in self._hists()}, "rejected": self.rejected.value}
        tmp = directory / f".metrics-{worker}.tmp"
        tmp.write_text(json.dumps(state))
        os.replace(tmp, directory / f"metrics-{worker}.json")

    def _hists(self) -> tuple[_Histograms, ...]:
        return self.ttft, self.itl, self.e2e

    def _read_peers(self) -> None:
        assert self._share is not None
        directory, worker = self._share
        sums = {h.names[0]: ([0] * len(h.counts), 0.0) for h in self._hists()}
        rejected = 0
        for path in directory.glob("metrics-*.json"):
            if path.name == f"metrics-{worker}.json":
                continue
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError):  # a process gone, or its first write not there yet
                continue
            rejected += state["rejected"]
            for name, (counts, total) in state["hist"].items():
                acc, acc_sum = sums[name]
                sums[name] = ([a + c for a, c in zip(acc, counts, strict=True)], acc_sum + total)
        for h in self._hists():
            h.peers = sums[h.names[0]]
        self.rejected.peers = rejected

    @property
    def snapshot(self) -> SchedulerSnapshot | None:
        return self._snapshot

    @snapshot.setter
    def snapshot(self, snapshot: SchedulerSnapshot) -> None:
        self._snapshot = snapshot
        now = time.monotonic()
        self._generated.append((now, snapshot.counters.generation_tokens))
        # Keep one point at or before the window's start: the baseline of the rate.
        while len(self._generated) > 2 and self._generated[1][0] <= now - THROUGHPUT_WINDOW_S:
            self._generated.popleft()

    def gen_throughput(self) -> float:
        """Tokens generated per second over the last THROUGHPUT_WINDOW_S seconds (0 when idle)."""
        if not self._generated:
            return 0.0
        now = time.monotonic()
        start = now - THROUGHPUT_WINDOW_S
        base_t, base_tokens = self._generated[0]
        for t, tokens in self._generated:
            if t > start:
                break
            base_t, base_tokens = t, tokens
        last_tokens = self._generated[-1][1]
        elapsed = now - base_t
        return (last_tokens - base_tokens) / elapsed if elapsed > 0 else 0.0

    def render(self) -> bytes:
        if self._share is not None:
            self._read_peers()
        return generate_latest(self.registry)
