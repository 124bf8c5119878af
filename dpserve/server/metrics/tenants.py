"""Per-tenant Prometheus series, with a bounded set of `tenant` labels.

Scope: `TenantMetrics`, a stats listener of `AsyncLLM` (beside `ServerMetrics`,
in its registry; several API servers sum through prometheus' multiprocess mode
like the other counters):

    dpserve:tenant_requests_total{tenant}           requests finished (one per prompt)
    dpserve:tenant_prompt_tokens_total{tenant}      their prompt tokens
    dpserve:tenant_generation_tokens_total{tenant}  their generated tokens
    dpserve:tenant_rejections_total{tenant,limit,api_server}
                                                    429s over a --tenant-limits limit
    dpserve:tenant_queue_time_seconds{tenant}       arrival in the engine to first
                                                    scheduled (the engine's phase_times)

Label cardinality: only the tenants the operator named get their own label (the
`--tenant-limits` file's names, `--api-key-file`'s keys, "default"); any other
tenant (a `--tenant-header` value the operator never named) is "other", so a
client cannot grow the series without bound.

Not here: the server-wide series (`dpserve.server.metrics.prometheus`), the limits
(`dpserve.server.tenants`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram

from dpserve.tenancy.limits import DEFAULT, LIMIT_NAMES

if TYPE_CHECKING:
    from dpserve.frontend.async_llm import IterationStats
    from dpserve.protocol import SchedulerStats

OTHER = "other"  # the label of every tenant not named
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                  40.0, 80.0, 160.0)


class TenantMetrics:
    """The `dpserve:tenant_*` series (module docstring)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, names: Iterable[str],
                 api_server_index: int = 0) -> None:
        self.model_name = model_name
        self.api_server = str(api_server_index)  # which API server refused
        self.names = frozenset(names) | {DEFAULT}
        labels, r = ["model_name", "tenant"], registry
        self.requests = Counter("dpserve:tenant_requests", "Requests finished, by tenant "
                                "(one per prompt).", labels, registry=r)
        self.prompt_tokens = Counter("dpserve:tenant_prompt_tokens", "Prompt tokens of the "
                                     "requests finished, by tenant.", labels, registry=r)
        self.generation_tokens = Counter("dpserve:tenant_generation_tokens", "Generated "
                                         "tokens, by tenant.", labels, registry=r)
        self.rejections = Counter("dpserve:tenant_rejections", "Requests refused (429) over "
                                  "a --tenant-limits limit, by tenant and limit.",
                                  labels + ["limit", "api_server"], registry=r)
        self.queue_time = Histogram("dpserve:tenant_queue_time_seconds", "Arrival in the "
                                    "engine to first scheduled, by tenant.", labels,
                                    buckets=_QUEUE_BUCKETS, registry=r)
        for name in sorted(self.names):  # zeros before the first request
            for metric in (self.requests, self.prompt_tokens, self.generation_tokens):
                metric.labels(model_name, name)

    def label(self, tenant: str | None) -> str:
        tenant = tenant or DEFAULT
        return tenant if tenant in self.names else OTHER

    def record(self, engine_index: int | None, scheduler_stats: SchedulerStats | None,
               iteration: IterationStats | None) -> None:
        if iteration is None:
            return
        for tenant, prompt, generated in iteration.tenant_tokens:
            labels = (self.model_name, self.label(tenant))
            self.requests.labels(*labels).inc()
            self.prompt_tokens.labels(*labels).inc(prompt)
            self.generation_tokens.labels(*labels).inc(generated)
        for tenant, phases in zip(iteration.phase_tenants, iteration.phase_times):
            self.queue_time.labels(self.model_name, self.label(tenant)).observe(phases[0])

    def rejected(self, tenant: str, limit: str) -> None:
        assert limit in LIMIT_NAMES, limit
        self.rejections.labels(self.model_name, self.label(tenant), limit,
                               self.api_server).inc()
