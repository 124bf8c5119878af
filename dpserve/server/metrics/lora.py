"""LoRA adapter metrics of an API server, per rank, from the engines' heartbeats.

Scope: `LoRAMetrics`, set at scrape time from the ranks' `EngineInfo.lora` (the
DP coordinator's copy of each engine's `LoRAReport`; without a coordinator,
N = 1, there is none and these series stay empty):

* `dpserve:lora_adapter_loaded{rank,adapter}` (gauge): 1 while the adapter is
  resident in one of the rank's device slots, 0 for one it holds only in host
  memory, or one the registry has that the rank does not (vLLM's
  `vllm:lora_requests_info` lists names; this says where they are);
* `dpserve:lora_adapter_loads{rank}` / `dpserve:lora_adapter_evictions{rank}`
  (counters): adapters put into a slot, and taken out of one for another,
  summed over the rank's processes (a restarted engine counts from 0 again: each
  incarnation's last figure is kept). With several API servers these are "max"
  gauges shown as the counters, as `dpserve.server.metrics.prometheus`' engine totals.

Not here: the registry (`dpserve.frontend.lora`), the reports (`dpserve.engine.lora_sync`).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge

from dpserve.frontend.rank_table import RankView


class LoRAMetrics:
    """See the module docstring. `cumulative_suffix`: several API servers (the name
    suffix of "max" gauges that the export shows as counters); None: one."""

    def __init__(self, registry: CollectorRegistry, cumulative_suffix: str | None) -> None:
        r = registry
        self.loaded = Gauge("dpserve:lora_adapter_loaded", "1 while a LoRA adapter is "
                            "resident in a device slot of the rank, else 0.",
                            ["rank", "adapter"], registry=r, multiprocess_mode="mostrecent")
        self.multiprocess = cumulative_suffix is not None
        self.totals: list[Counter | Gauge] = [
            Counter(name, doc, ["rank"], registry=r) if cumulative_suffix is None else
            Gauge(name + cumulative_suffix, doc, ["rank"], registry=r, multiprocess_mode="max")
            for name, doc in (("dpserve:lora_adapter_loads", "LoRA adapters put into a "
                               "device slot."),
                              ("dpserve:lora_adapter_evictions", "LoRA adapters taken out "
                               "of a device slot for another."))]
        self._seen: dict[int, set[str]] = {}  # rank -> adapters with a series
        # rank -> incarnation -> its last (loads, evictions)
        self._by_incarnation: dict[int, dict[int, tuple[int, int]]] = {}
        self._counted: dict[int, tuple[int, int]] = {}  # rank -> (loads, evictions) counted

    def update(self, ranks: Iterable[RankView], registry: dict[str, str] | None) -> None:
        """The ranks' adapters now (`registry`: the names every rank should hold)."""
        for view in ranks:
            report = view.info.lora
            if report is None:
                continue
            names = self._seen.setdefault(view.rank, set())
            names.update(report.resident, report.cached, registry or ())
            for name in names:
                self.loaded.labels(str(view.rank), name).set(int(name in report.resident))
            runs = self._by_incarnation.setdefault(view.rank, {})
            runs[view.incarnation] = (report.loads, report.evictions)
            self._count(view.rank, tuple(sum(f[i] for f in runs.values()) for i in (0, 1)))

    def _count(self, rank: int, totals: tuple[int, ...]) -> None:
        old = self._counted.get(rank, (0, 0))
        for metric, new, before in zip(self.totals, totals, old):
            child = metric.labels(str(rank))
            if self.multiprocess:
                child.set(new)  # type: ignore[union-attr]
            elif new > before:
                child.inc(new - before)  # type: ignore[union-attr]
        self._counted[rank] = (totals[0], totals[1])
