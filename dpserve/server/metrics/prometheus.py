"""Prometheus metrics of the API servers.

`ServerMetrics` is a `StatsListener` of `AsyncLLM`: every engine message
brings the engine's `SchedulerStats` (request counts, KV-cache usage,
prefix-cache counters) and the front-end's `IterationStats` (tokens, first
token and inter-token latencies, finished requests). Engine gauges carry an
`engine` label (the engine index), so data parallel adds series, not metrics;
`dpserve:engine_requests_finished` counts finished requests per engine (how
the load was spread), `dpserve:api_server_requests_finished` per API server.
The KV host tier's series (`--kv-offload-memory`) are `dpserve.server.metrics.kv_tier`'.

One API server (the main process): each instance has its own registry, no
module-global state. Several API-server processes (`--api-server-count`):
PROMETHEUS_MULTIPROC_DIR is set before prometheus_client is imported, every
process writes its values to files there and a scrape, answered by any one
of them, merges them all:

* counters and histograms are summed over the API servers;
* engine gauges take the most recent value any API server was sent
  (multiprocess_mode "mostrecent");
* the engine's own cumulative counters (prefix-cache queries and hits,
  preemptions) reach an API server only with its own requests' outputs, so
  per-process increments would count one engine's work once per API server:
  each process records the cumulative figure in a "max" gauge, shown on
  scrape as the counter it stands for (same name, `_total`). Invariant: an
  engine's cumulative figures only grow (an engine never restarts in place).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from dpserve.protocol import RankState
from dpserve.server.metrics.kv_tier import KVTierMetrics
from dpserve.server.metrics.lora import LoRAMetrics

disable_created_metrics()  # no `*_created` series: dpserve's dashboards never read them

if TYPE_CHECKING:
    from dpserve.frontend.async_llm import IterationStats
    from dpserve.protocol import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                50.0, 60.0, 120.0, 240.0, 480.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

# Engine-cumulative counters: name -> help. Multiprocess: a "max" gauge named
# name + _CUMULATIVE holds the figure; `_MultiProcessExport` shows it as the counter.
_ENGINE_TOTALS = {
    "dpserve:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "dpserve:prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "dpserve:num_preemptions": "Requests preempted.",
    "dpserve:pooling_requests": "Pooling (embedding) requests finished by the engine.",
    "dpserve:pooling_steps": "Engine steps that finished at least one pooling request "
                             "(fewer than the requests: they were batched).",
    # Speculative decoding (--speculative-config): vLLM's vllm:spec_decode_* counters.
    "dpserve:spec_decode_num_drafts": "Requests' steps verified with draft tokens.",
    "dpserve:spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "dpserve:spec_decode_num_accepted_tokens": "Draft tokens accepted.",
}
_CUMULATIVE = ":engine_cumulative"


class ServerMetrics:
    """All dpserve metrics, named `dpserve:*`, in a registry of their own."""

    def __init__(self, model_name: str, api_server_index: int = 0) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.api_server_index = api_server_index
        self.multiprocess_dir = _multiprocess_dir()
        self._add_request_metrics(model_name, api_server_index)
        self._add_engine_metrics()
        self._add_dp_metrics(model_name)
        self.lora = LoRAMetrics(self.registry, None if self.multiprocess_dir is None
                                else _CUMULATIVE)  # set at scrape time (ops/routes.py)
        self.kv_tier = KVTierMetrics(self.registry, None if self.multiprocess_dir is None
                                     else _CUMULATIVE)  # with each engine's stats
        self._decisions = [0, 0]  # (up, down) already counted
        self._moved = (0, 0, 0)  # (retries, migrations, recomputed tokens) already counted
        self._restarts: dict[int, int] = {}  # engine -> restarts already counted
        # engine index -> last cumulative figures seen (as `engine_totals`)
        self._last: dict[int, tuple[int, ...]] = {}
        self._export: CollectorRegistry | None = None
        if self.multiprocess_dir is not None:
            self._export = CollectorRegistry(auto_describe=False)
            self._export.register(_MultiProcessExport(self.multiprocess_dir))
        # process_* (CPU, memory, open files) of the process answering the scrape.
        ProcessCollector(registry=self._export if self._export is not None else self.registry)

    def _add_request_metrics(self, model_name: str, api_server_index: int) -> None:
        """Per request, counted in this API server: tokens, latencies, finishes."""
        r, m = self.registry, ["model_name"]
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
        # Phases of a request in its engine (EngineCoreOutput.phase_times), vLLM's set.
        self.phases = [Histogram(f"dpserve:request_{phase}_time_seconds", doc, m,
                                 buckets=_E2E_BUCKETS, registry=r) for phase, doc in (
            ("queue", "Arrival in the engine to first scheduled."),
            ("prefill", "First scheduled to first token."),
            ("decode", "First token to finish."),
            ("inference", "First scheduled to finish (prefill + decode)."))]
        self.api_server_finished = Counter("dpserve:api_server_requests_finished", "Requests "
                                           "finished by an API server (one per completion).",
                                           m + ["api_server"], registry=r)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)  # show zeros before the first request
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)
        self.api_server_finished.labels(model_name, str(api_server_index))

    def _add_engine_metrics(self) -> None:
        """Per engine, from its `SchedulerStats` and outputs: load, KV, cache, state."""
        r, e = self.registry, ["model_name", "engine"]
        latest = dict(registry=r, multiprocess_mode="mostrecent")  # ignored by one process
        self.running = Gauge("dpserve:num_requests_running", "Requests running in the engine.",
                             e, **latest)
        self.waiting = Gauge("dpserve:num_requests_waiting", "Requests waiting in the engine.",
                             e, **latest)
        self.kv_usage = Gauge("dpserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in "
                              "use (0-1).", e, **latest)
        self.engine_wave = Gauge("dpserve:engine_wave", "The engine's data-parallel request "
                                 "wave when it last sent outputs (lockstep).", e, **latest)
        self.prefix_hit_rate = Gauge("dpserve:prefix_cache_hit_rate", "Prompt tokens found "
                                     "in the prefix cache / tokens looked up, since start.",
                                     e, **latest)
        # [8] prefix-cache queries, hits, preemptions, pooling requests and steps, spec
        # decode drafts, draft and accepted tokens: Counters, or "max" Gauges (multiprocess)
        self.engine_totals: list[Counter | Gauge] = [
            Counter(name, doc, e, registry=r) if self.multiprocess_dir is None else
            Gauge(name + _CUMULATIVE, doc, e, registry=r, multiprocess_mode="max")
            for name, doc in _ENGINE_TOTALS.items()]
        self.prefix_queries, self.prefix_hits, self.preemptions = self.engine_totals[:3]
        self.engine_finished = Counter("dpserve:engine_requests_finished", "Requests "
                                       "finished by an engine (one per completion).", e,
                                       registry=r)
        self.engine_state = Gauge("dpserve:engine_state", "1 for each DP rank's current "
                                  "state (starting, serving, unhealthy, dead, restarting, "
                                  "draining), else 0.", e + ["state"], **latest)
        self.engine_restarts = (
            Counter("dpserve:engine_restarts", "Processes started to replace a dead engine.",
                    e, registry=r) if self.multiprocess_dir is None else
            Gauge("dpserve:engine_restarts" + _CUMULATIVE, "Processes started to replace a "
                  "dead engine.", e, registry=r, multiprocess_mode="max"))

    def _add_dp_metrics(self, model_name: str) -> None:
        """Data parallel: the wave, moved requests, the engine count, autoscaling."""
        r, m = self.registry, ["model_name"]
        self.wave = Gauge("dpserve:dp_wave", "The data-parallel request wave (lockstep; "
                          "from the DP coordinator).", registry=r, multiprocess_mode="max")
        self.retries = Counter("dpserve:request_retries", "Requests re-sent to another rank "
                               "before their first token (their rank failed).", m, registry=r)
        self.migrations = Counter("dpserve:request_migrations", "Requests moved mid-stream to "
                                  "another rank with the tokens they had (their rank "
                                  "failed).", m, registry=r)
        self.recomputed = Counter("dpserve:request_recomputed_tokens", "Prompt and generated "
                                  "tokens prefilled again because their request moved.", m,
                                  registry=r)
        for counter in (self.retries, self.migrations, self.recomputed):
            counter.labels(model_name)
        self.dp_size = Gauge("dpserve:data_parallel_size", "The number of DP engines now "
                             "(it changes when the server scales).", registry=r,
                             multiprocess_mode="mostrecent")
        # Made by the coordinator: a "max" gauge (multiprocess), shown as the counter.
        self.autoscale = (
            Counter("dpserve:autoscale_decisions", "Engines added (up) or removed (down) "
                    "by the autoscaler.", ["direction"], registry=r)
            if self.multiprocess_dir is None else
            Gauge("dpserve:autoscale_decisions" + _CUMULATIVE, "Engines added (up) or "
                  "removed (down) by the autoscaler.", ["direction"], registry=r,
                  multiprocess_mode="max"))

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
        self.engine_wave.labels(*labels).set(s.wave)
        queries = s.prefix_cache_queries
        self.prefix_hit_rate.labels(*labels).set(s.prefix_cache_hits / queries if queries
                                                 else 0.0)
        self.kv_tier.record(labels, s)
        now = (queries, s.prefix_cache_hits, s.num_preemptions, s.num_pooled_requests,
               s.num_pooling_steps, s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens,
               s.spec_decode_num_accepted_tokens)
        if self.multiprocess_dir is not None:
            for gauge, value in zip(self.engine_totals, now):
                gauge.labels(*labels).set(value)  # type: ignore[union-attr]
            return
        last = self._last.get(engine_index, (0,) * len(now))
        for counter, new, old in zip(self.engine_totals, now, last):
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
        for queued, prefill, decode in it.phase_times:
            for histogram, value in zip(self.phases, (queued, prefill, decode,
                                                      prefill + decode)):
                histogram.labels(name).observe(value)
        for f in it.finished:
            self.request_success.labels(name, f.finish_reason).inc()
            self.e2e.labels(name).observe(f.e2e_latency)
        if it.finished:
            self.api_server_finished.labels(name, str(self.api_server_index)).inc(
                len(it.finished))

    def set_wave(self, wave: int) -> None:
        self.wave.set(wave)

    def record_moved(self, moved: tuple[int, int, int]) -> None:
        """This API server's running totals of (re-sent requests, migrated requests,
        recomputed tokens): counted as they change, in every API server (not only
        in the one that answers a scrape)."""
        if moved == self._moved:
            return
        for counter, new, old in zip((self.retries, self.migrations, self.recomputed), moved,
                                     self._moved):
            counter.labels(self.model_name).inc(max(0, new - old))
        self._moved = moved

    def set_elastic(self, size: int, decisions: list[int] | None) -> None:
        """The engine count now, and the autoscaler's [up, down] decisions (None: off)."""
        self.dp_size.set(size)
        if decisions is None:
            return
        for i, direction in enumerate(("up", "down")):
            metric = self.autoscale.labels(direction)
            if self.multiprocess_dir is not None:
                metric.set(decisions[i])  # type: ignore[union-attr]
            else:
                metric.inc(max(0, decisions[i] - self._decisions[i]))  # type: ignore[union-attr]
        self._decisions = list(decisions)

    def set_ranks(self, states: dict[int, tuple[str, int]]) -> None:
        """The front-end's view at scrape time: rank -> (state, incarnation = restarts)."""
        for rank, (state, restarts) in states.items():
            labels = (self.model_name, str(rank))
            for s in RankState:
                self.engine_state.labels(*labels, s.value).set(int(s.value == state))
            if self.multiprocess_dir is not None:
                self.engine_restarts.labels(*labels).set(restarts)  # type: ignore[union-attr]
            elif restarts > self._restarts.get(rank, 0):
                self.engine_restarts.labels(*labels).inc(restarts - self._restarts.get(rank, 0))
            else:
                self.engine_restarts.labels(*labels)
            self._restarts[rank] = max(restarts, self._restarts.get(rank, 0))

    def render(self) -> bytes:
        """The text exposition format, for GET /metrics (all API servers' values)."""
        return generate_latest(self._export if self._export is not None else self.registry)


class _MultiProcessExport:
    """Every API server's values from the multiprocess dir; engine-cumulative
    "max" gauges are shown as the counters they stand for."""

    def __init__(self, path: str) -> None:
        self._files = MultiProcessCollector(None, path)

    def collect(self) -> Iterator[Metric]:
        for metric in self._files.collect():
            name = metric.name.removesuffix(_CUMULATIVE)
            if name == metric.name:
                yield metric
                continue
            counter = Metric(name, metric.documentation, "counter")
            for sample in metric.samples:
                counter.add_sample(name + "_total", sample.labels, sample.value)
            yield counter


def _multiprocess_dir() -> str | None:
    """$PROMETHEUS_MULTIPROC_DIR when prometheus_client runs in multiprocess mode."""
    path = os.environ.get(MULTIPROC_DIR_ENV)
    if path is None:
        return None
    if not getattr(values.ValueClass, "_multiprocess", False):
        raise RuntimeError(f"{MULTIPROC_DIR_ENV} was set after prometheus_client was "
                           f"imported: set it first (it picks multiprocess mode on import)")
    return path
