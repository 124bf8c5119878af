"""KV host tier metrics of an API server, per engine, from the engines' `SchedulerStats`.

Scope: `KVTierMetrics`, fed by `ServerMetrics` with every engine message's stats
whose engine has a tier (`--kv-offload-memory`: it reports the store's size, or
has looked blocks up there); a server without one shows no series. vLLM's names
where it has them (its KV connector's and OffloadingConnector's):

* `dpserve:external_prefix_cache_queries` / `dpserve:external_prefix_cache_hits`
  (counters, tokens): prompt tokens the engine looked up in the host tier (after
  its own prefix cache missed) and found there (loaded instead of computed);
* `dpserve:kv_offload_load_bytes` / `dpserve:kv_offload_store_bytes` (counters):
  bytes copied from the tier into the engine's KV cache, and saved to it;
* `dpserve:kv_offload_load_time` (counter, seconds): time the loads took;
* `dpserve:kv_offload_cpu_cache_usage_perc` (gauge, 0-1): the host's store, blocks
  held / blocks it can hold (every rank of a host reports the same store);
* `dpserve:kv_offload_cpu_cache_blocks` (gauge): the blocks it can hold (0: not
  reported, or the store is down).

All carry `model_name` and `engine`. The engine's figures are cumulative per
process: one API server counts the increments (a restarted engine counts from 0
again); with several API servers each records the figure in a "max" gauge that the
export shows as the counter (`dpserve.server.metrics.prometheus`' engine totals).

Not here: the store (`dpserve.kv_tier`), the engine's counting (`dpserve.engine`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from dpserve.protocol import SchedulerStats

# Engine-cumulative figures: metric name -> (help, the SchedulerStats field).
TIER_TOTALS = {
    "dpserve:external_prefix_cache_queries": (
        "Prompt tokens looked up in the KV host tier (after a local prefix-cache miss).",
        "kv_tier_queries"),
    "dpserve:external_prefix_cache_hits": (
        "Prompt tokens found in the KV host tier (loaded instead of computed).",
        "kv_tier_hits"),
    "dpserve:kv_offload_load_bytes": (
        "Bytes loaded from the KV host tier into the engine's KV cache.",
        "kv_tier_loaded_bytes"),
    "dpserve:kv_offload_store_bytes": (
        "Bytes saved from the engine's KV cache to the KV host tier.", "kv_tier_saved_bytes"),
    "dpserve:kv_offload_load_time": (
        "Seconds spent loading from the KV host tier.", "kv_tier_load_seconds"),
}


def has_tier(stats: SchedulerStats) -> bool:
    """The engine runs with a host tier (it knows the store's size, or has used it)."""
    return stats.kv_tier_num_blocks > 0 or stats.kv_tier_queries > 0


class KVTierMetrics:
    """See the module docstring. `cumulative_suffix`: several API servers (the name
    suffix of "max" gauges that the export shows as counters); None: one."""

    def __init__(self, registry: CollectorRegistry, cumulative_suffix: str | None) -> None:
        r, e = registry, ["model_name", "engine"]
        self.multiprocess = cumulative_suffix is not None
        self.totals: list[Counter | Gauge] = [
            Counter(name, doc, e, registry=r) if cumulative_suffix is None else
            Gauge(name + cumulative_suffix, doc, e, registry=r, multiprocess_mode="max")
            for name, (doc, _) in TIER_TOTALS.items()]
        self.fields = [field for _, field in TIER_TOTALS.values()]
        latest = dict(registry=r, multiprocess_mode="mostrecent")
        self.usage = Gauge("dpserve:kv_offload_cpu_cache_usage_perc", "Fraction of the KV "
                           "host tier's blocks in use (0-1; the host's store, shared by its "
                           "ranks).", e, **latest)
        self.capacity = Gauge("dpserve:kv_offload_cpu_cache_blocks", "KV blocks the host "
                              "tier can hold (0: not reported, or its store is down).", e,
                              **latest)
        self._last: dict[str, tuple[float, ...]] = {}  # engine -> its last cumulative figures

    def record(self, labels: tuple[str, str], s: SchedulerStats) -> None:
        """One engine message's stats (`labels`: model name, engine index)."""
        if not has_tier(s):
            return
        self.usage.labels(*labels).set(s.kv_tier_used_blocks / s.kv_tier_num_blocks
                                       if s.kv_tier_num_blocks else 0.0)
        self.capacity.labels(*labels).set(s.kv_tier_num_blocks)
        now = tuple(float(getattr(s, field)) for field in self.fields)
        if self.multiprocess:
            for gauge, value in zip(self.totals, now):
                gauge.labels(*labels).set(value)  # type: ignore[union-attr]
            return
        last = self._last.get(labels[1], (0.0,) * len(now))
        for counter, new, old in zip(self.totals, now, last):
            # Cumulative in the engine; a restarted engine starts again from 0.
            counter.labels(*labels).inc(new - old if new >= old else new)  # type: ignore[union-attr]
        self._last[labels[1]] = now
