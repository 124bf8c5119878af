"""The KV host tier's Prometheus series (`dpserve.server.metrics.kv_tier`, fed by
`ServerMetrics` with the engines' `SchedulerStats`) in the real exposition text:
vLLM's names, per engine, counted from the engines' cumulative figures (a restarted
engine counts from 0 again), merged over API-server processes, and absent on a
server without a tier; and the `kv_tier` figures of an /engines row."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from dpserve.protocol import SchedulerStats
from dpserve.server.metrics.prometheus import ServerMetrics
from dpserve.server.ops.engines import _tier

GIB = 1 << 30


def stats(queries: int, hits: int, loaded: int = 0, saved: int = 0, seconds: float = 0.0,
          num_blocks: int = 100, used: int = 0) -> SchedulerStats:
    return SchedulerStats(0, 1, 0.5, 0, 0, 0, 10, kv_tier_queries=queries, kv_tier_hits=hits,
                          kv_tier_loaded_bytes=loaded, kv_tier_saved_bytes=saved,
                          kv_tier_load_seconds=seconds, kv_tier_num_blocks=num_blocks,
                          kv_tier_used_blocks=used)


def value(text: str, metric: str, engine: str) -> float:
    m = re.search(rf'^{re.escape(metric)}\{{engine="{engine}",model_name="tiny"\}} (\S+)$',
                  text, re.M)
    assert m, f"no {metric} for engine {engine} in:\n{text}"
    return float(m.group(1))


def test_tier_series_count_the_engines_figures_per_engine():
    metrics = ServerMetrics("tiny")
    metrics.record(0, stats(64, 32, loaded=GIB, saved=2 * GIB, seconds=0.5, used=25), None)
    metrics.record(0, stats(96, 48, loaded=GIB, saved=2 * GIB, seconds=0.75, used=50), None)
    metrics.record(1, stats(16, 0, num_blocks=0), None)  # its store is down
    text = metrics.render().decode()
    assert value(text, "dpserve:external_prefix_cache_queries_total", "0") == 96
    assert value(text, "dpserve:external_prefix_cache_hits_total", "0") == 48
    assert value(text, "dpserve:kv_offload_load_bytes_total", "0") == GIB
    assert value(text, "dpserve:kv_offload_store_bytes_total", "0") == 2 * GIB
    assert value(text, "dpserve:kv_offload_load_time_total", "0") == 0.75
    assert value(text, "dpserve:kv_offload_cpu_cache_usage_perc", "0") == 0.5
    assert value(text, "dpserve:kv_offload_cpu_cache_blocks", "0") == 100
    assert value(text, "dpserve:external_prefix_cache_queries_total", "1") == 16
    assert value(text, "dpserve:kv_offload_cpu_cache_usage_perc", "1") == 0.0
    assert value(text, "dpserve:kv_offload_cpu_cache_blocks", "1") == 0
    # Engine 0 restarted: its new process counts from 0, and the counter goes on.
    metrics.record(0, stats(8, 8, used=50), None)
    text = metrics.render().decode()
    assert value(text, "dpserve:external_prefix_cache_queries_total", "0") == 104
    assert value(text, "dpserve:external_prefix_cache_hits_total", "0") == 56


def test_no_tier_no_series():
    metrics = ServerMetrics("tiny")
    metrics.record(0, SchedulerStats(0, 1, 0.5, 10, 5, 0, 10), None)
    text = metrics.render().decode()
    assert "# TYPE dpserve:external_prefix_cache_hits_total counter" in text
    assert not re.search(r"^dpserve:(external_prefix_cache|kv_offload)\w*\{", text, re.M)
    assert _tier(SchedulerStats(0, 1, 0.5, 10, 5, 0, 10)) is None and _tier(None) is None


_RECORD = """
import sys
from dpserve.protocol import SchedulerStats
from dpserve.server.metrics.prometheus import ServerMetrics

index, queries, used = map(int, sys.argv[1:])
metrics = ServerMetrics("tiny", api_server_index=index)
metrics.record(0, SchedulerStats(0, 1, 0.5, 0, 0, 0, 10, kv_tier_queries=queries,
                                 kv_tier_hits=queries // 2, kv_tier_num_blocks=100,
                                 kv_tier_used_blocks=used), None)
sys.stdout.write(metrics.render().decode())
"""


@pytest.mark.procs
def test_several_api_servers_count_an_engines_figures_once(tmp_path):
    def run(*argv: int) -> str:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
        return subprocess.run([sys.executable, "-c", _RECORD, *map(str, argv)], env=env,
                              capture_output=True, text=True, check=True, timeout=60).stdout

    run(0, 30, 10)
    text = run(1, 40, 20)  # the other API server saw the engine later, and scrapes
    assert "# TYPE dpserve:external_prefix_cache_queries_total counter" in text
    assert value(text, "dpserve:external_prefix_cache_queries_total", "0") == 40
    assert value(text, "dpserve:external_prefix_cache_hits_total", "0") == 20
    assert value(text, "dpserve:kv_offload_cpu_cache_usage_perc", "0") == 0.2  # the latest


def test_an_engines_row_shows_its_tier():
    row = _tier(stats(96, 48, loaded=GIB, saved=2 * GIB, seconds=0.75, used=50))
    assert row == {"hits": 48, "queries": 96, "loaded_bytes": GIB, "saved_bytes": 2 * GIB,
                   "load_seconds": 0.75, "used_blocks": 50, "num_blocks": 100}
