"""Prometheus metrics of one API server.

`ServerMetrics` is a `StatsListener` of `AsyncLLM`: every engine message
brings the engine's `SchedulerStats` (request counts, KV-cache usage,
prefix-cache counters) and the front-end's `IterationStats` (tokens, first
token and inter-token latencies, finished requests). Engine gauges carry an
`engine` label (the engine index), so data parallel adds series, not metrics;
`dpserve:engine_requests_finished` counts finished requests per engine (how
the load was spread).
Each instance has its own registry: no module-global state.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from dpserve.frontend.async_llm import IterationStats
from dpserve.protocol import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """All dpserve metrics, named `dpserve:*`, in a registry of their own."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, m = self.registry, ["model_name"]
        e = ["model_name", "engine"]
        self.request_success = Counter("dpserve:request_success", "Finished requests (one per "
                                       "completion), by finish reason.",
                                       m + ["finished_reason"], registry=r)
        self.prompt_tokens = Counter("dpserve:prompt_tokens", "Prefilled prompt tokens.", m,
                                     registry=r)
        self.generation_tokens = Counter("dpserve:generation_tokens", "Generated tokens.", m,
                                         registry=r)
        self.ttft = Histogram("dpserve:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dpserve:inter_token_latency_seconds", "Time between two "
                             "outputs of one request.", m, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("dpserve:e2e_request_latency_seconds", "Arrival to finish.", m,
                             buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge("dpserve:num_requests_running", "Requests running in the engine.",
                             e, registry=r)
        self.waiting = Gauge("dpserve:num_requests_waiting", "Requests waiting in the engine.",
                             e, registry=r)
        self.kv_usage = Gauge("dpserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in "
                              "use (0-1).", e, registry=r)
        self.prefix_hit_rate = Gauge("dpserve:prefix_cache_hit_rate", "Prompt tokens found "
                                     "in the prefix cache / tokens looked up, since start.",
                                     e, registry=r)
        self.prefix_queries = Counter("dpserve:prefix_cache_queries", "Prompt tokens looked "
                                      "up in the prefix cache.", e, registry=r)
        self.prefix_hits = Counter("dpserve:prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache.", e, registry=r)
        self.engine_finished = Counter("dpserve:engine_requests_finished", "Requests "
                                       "finished by an engine (one per completion).", e,
                                       registry=r)
        self.preemptions = Counter("dpserve:num_preemptions", "Requests preempted.", e,
                                   registry=r)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)  # show zeros before the first request
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        # engine index -> last cumulative (queries, hits, preemptions) seen
        self._last: dict[int, tuple[int, int, int]] = {}

    def record(self, engine_index: int | None, scheduler_stats: SchedulerStats | None,
               iteration: IterationStats | None) -> None:
        """One engine message's stats (engine_index None: not from an engine)."""
        if engine_index is not None and scheduler_stats is not None:
            self._record_engine(engine_index, scheduler_stats)
        if iteration is not None:
            self._record_iteration(iteration)
            if engine_index is not None and iteration.finished:
                self.engine_finished.labels(self.model_name, str(engine_index)).inc(
                    len(iteration.finished))

    def _record_engine(self, engine_index: int, s: SchedulerStats) -> None:
        labels = (self.model_name, str(engine_index))
        self.running.labels(*labels).set(s.num_running)
        self.waiting.labels(*labels).set(s.num_waiting)
        self.kv_usage.labels(*labels).set(s.kv_cache_usage)
        queries = s.prefix_cache_queries
        self.prefix_hit_rate.labels(*labels).set(s.prefix_cache_hits / queries if queries
                                                 else 0.0)
        now = (queries, s.prefix_cache_hits, s.num_preemptions)
        last = self._last.get(engine_index, (0, 0, 0))
        for counter, new, old in zip((self.prefix_queries, self.prefix_hits, self.preemptions),
                                     now, last):
            # Cumulative in the engine; a restarted engine starts again from 0.
            counter.labels(*labels).inc(new - old if new >= old else new)
        self._last[engine_index] = now

    def _record_iteration(self, it: IterationStats) -> None:
        name = self.model_name
        if it.num_prompt_tokens:
            self.prompt_tokens.labels(name).inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.labels(name).inc(it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.labels(name).observe(t)
        for t in it.inter_token_latencies:
            self.itl.labels(name).observe(t)
        for f in it.finished:
            self.request_success.labels(name, f.finish_reason).inc()
            self.e2e.labels(name).observe(f.e2e_latency)

    def render(self) -> bytes:
        """The text exposition format, for GET /metrics."""
        return generate_latest(self.registry)
