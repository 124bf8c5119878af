"""Prefill/decode disaggregation metrics of an API server (`--data-parallel-roles`).

Scope: `PDMetrics`, a stats listener of `AsyncLLM` (`install_pd_metrics`: only
when roles are on), in `ServerMetrics`' registry:

* `dpserve:pd_handoffs` (counter): continuations this API server sent from a
  prefill rank to another rank; `dpserve:pd_handoffs_colocated` (counter): first
  legs that went on where they were (no other rank serving);
* `dpserve:pd_handoffs_in_flight` (gauge): first token in, the decode rank's first
  output not yet;
* `dpserve:pd_handoff_latency_seconds` (histogram): a handoff's first token ->
  its decode rank's first output (the continuation placed, pulled when cross-host,
  admitted, its tail computed and one token sampled);
* `dpserve:pd_pulled_blocks` (counter): KV blocks a decode host's store held after
  a cross-host pull (`dpserve.kv_tier.pull`; the bytes are blocks x the tier's slot);
* `dpserve:pd_time_to_first_token_seconds` / `dpserve:pd_inter_token_latency_seconds`
  (histograms, label `role`): TTFT and ITL by the role of the rank whose output
  carried the token (a handoff's first token: prefill; the gap to its second: decode);
* `dpserve:pd_num_requests_waiting` (gauge, label `role`): requests waiting at the
  ranks of each role, from their last figures sent to this API server.

All carry `model_name`. Counts are this API server's (several API servers: summed
by the multiprocess export, the in-flight gauge too).

Not here: the handoff (`dpserve.frontend.handoff`), the other metrics
(`dpserve.server.metrics.prometheus`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dpserve.frontend.cluster import ClusterView
from dpserve.frontend.migration import HandoffCounts
from dpserve.frontend.roles import DECODE, PREFILL, Roles, roles_of

if TYPE_CHECKING:
    from dpserve.frontend.async_llm import AsyncLLM, IterationStats
    from dpserve.protocol import SchedulerStats

_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            10.0, 20.0, 40.0)


def install_pd_metrics(async_llm: AsyncLLM, registry: CollectorRegistry, model_name: str
                       ) -> PDMetrics | None:
    """With `--data-parallel-roles`: a `PDMetrics` listening to `async_llm`; else None."""
    roles = roles_of(async_llm.config.parallel.data_parallel_roles)
    if roles is None:
        return None
    listener = PDMetrics(registry, model_name, roles, async_llm.cluster)
    async_llm.add_stats_listener(listener)
    return listener


class PDMetrics:
    """See the module docstring. `roles`: the ranks' roles; `cluster`: where the
    handoff counts come from."""

    def __init__(self, registry: CollectorRegistry, model_name: str, roles: Roles,
                 cluster: ClusterView) -> None:
        r, m = registry, ["model_name"]
        self.model_name, self.roles, self.cluster = model_name, roles, cluster
        self.handoffs = Counter("dpserve:pd_handoffs", "Continuations sent from a prefill "
                                "rank to another rank.", m, registry=r)
        self.colocated = Counter("dpserve:pd_handoffs_colocated", "First legs that went on "
                                 "where they were (no other rank serving).", m, registry=r)
        self.pulled = Counter("dpserve:pd_pulled_blocks", "KV blocks a decode host's store "
                              "held after a cross-host pull.", m, registry=r)
        self.in_flight = Gauge("dpserve:pd_handoffs_in_flight", "Handoffs whose first token "
                               "came and whose decode rank has not answered yet.", m,
                               registry=r, multiprocess_mode="livesum")
        self.latency = Histogram("dpserve:pd_handoff_latency_seconds", "A handoff's first "
                                 "token to its decode rank's first output.", m,
                                 buckets=_BUCKETS, registry=r)
        self.ttft = Histogram("dpserve:pd_time_to_first_token_seconds", "Time to first "
                              "token, by the role of the rank that sent it.", m + ["role"],
                              buckets=_BUCKETS, registry=r)
        self.itl = Histogram("dpserve:pd_inter_token_latency_seconds", "Time between two "
                             "outputs of one request, by the role of the rank that sent the "
                             "second.", m + ["role"], buckets=_BUCKETS, registry=r)
        self.waiting = Gauge("dpserve:pd_num_requests_waiting", "Requests waiting at the "
                             "ranks of each role.", m + ["role"], registry=r,
                             multiprocess_mode="mostrecent")
        for role in (PREFILL, DECODE):
            for metric in (self.ttft, self.itl, self.waiting):
                metric.labels(model_name, role)
        for metric in (self.handoffs, self.colocated, self.pulled, self.latency):
            metric.labels(model_name)
        self._counted = HandoffCounts()
        self._waiting: dict[int, int] = {}  # engine -> its last num_waiting

    def record(self, engine_index: int | None, scheduler_stats: SchedulerStats | None,
               iteration: IterationStats | None) -> None:
        """One engine message's stats (`StatsListener`)."""
        name = self.model_name
        if engine_index is not None:
            role = self.roles.role_of(engine_index)
            if scheduler_stats is not None:
                self._waiting[engine_index] = scheduler_stats.num_waiting
                self.waiting.labels(name, role).set(sum(
                    w for rank, w in self._waiting.items() if self.roles.role_of(rank) == role))
            for t in iteration.time_to_first_tokens if iteration is not None else ():
                self.ttft.labels(name, role).observe(t)
            for t in iteration.inter_token_latencies if iteration is not None else ():
                self.itl.labels(name, role).observe(t)
        self.update()

    def update(self) -> None:
        """Bring the handoff counters and latencies up to the engine client's."""
        name, now, old = self.model_name, self.cluster.handoffs, self._counted
        for counter, new, before in ((self.handoffs, now.handoffs, old.handoffs),
                                     (self.colocated, now.colocated, old.colocated),
                                     (self.pulled, now.pulled_blocks, old.pulled_blocks)):
            if new > before:
                counter.labels(name).inc(new - before)
        self._counted = now
        self.in_flight.labels(name).set(now.in_flight)
        for t in self.cluster.take_handoff_latencies():
            self.latency.labels(name).observe(t)
