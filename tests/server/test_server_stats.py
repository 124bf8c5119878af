"""Request phase histograms (queue / prefill / decode / inference time, fed from the
engines' per-request times), process_* metrics, and the periodic per-engine stats
line, on a real DP=2 server with two API servers (multiprocess metrics) and on one
with a single API server."""

from __future__ import annotations

import re

import httpx
import pytest
from helpers import metric_sum, output, serve_all, wait_until

pytestmark = pytest.mark.procs

PHASES = ("queue", "prefill", "decode", "inference")
LINE = re.compile(r"engine (\d): prompt [\d.]+ tok/s, generation ([\d.]+) tok/s, running \d+, "
                  r"waiting \d+, KV cache [\d.]+%")


def run_requests(url: str, count: int) -> None:
    for i in range(count):
        r = httpx.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": [5, 6, 7, 8 + i], "max_tokens": 8, "ignore_eos": True},
            timeout=60)
        assert r.status_code == 200, r.text


def check_phase_metrics(url: str, count: int) -> None:
    for phase in PHASES:
        name = f"dpserve:request_{phase}_time_seconds"
        assert metric_sum(url, name + "_count") == count, phase
        assert metric_sum(url, name + "_sum") >= 0, phase
    # Eight tokens: decoding took some time; prefill + decode = inference.
    assert metric_sum(url, "dpserve:request_decode_time_seconds_sum") > 0
    inference = metric_sum(url, "dpserve:request_inference_time_seconds_sum")
    parts = sum(metric_sum(url, f"dpserve:request_{p}_time_seconds_sum")
                for p in ("prefill", "decode"))
    assert inference == pytest.approx(parts, rel=1e-6, abs=1e-6)
    assert metric_sum(url, "process_resident_memory_bytes") > 0
    assert metric_sum(url, "process_cpu_seconds_total") > 0


@pytest.fixture(scope="module")
def servers(tiny_llama):
    """This module's three servers, started at once (their start-ups overlap); each
    test uses its own one."""
    model = str(tiny_llama)
    with serve_all(*([model, "--served-model-name", "tiny", "-dp", "2", "--api-server-count",
                      api_servers, "--log-stats-interval", "0.5"] for api_servers in "12"),
                   [model, "--served-model-name", "tiny", "--disable-log-stats",
                    "--log-stats-interval", "0.2"]) as procs:
        yield dict(zip(("1", "2", "no_stats"), procs))


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_phase_histograms_process_metrics_and_stats_line(servers, api_servers) -> None:
    proc, url = servers[api_servers]
    run_requests(url, 6)
    check_phase_metrics(url, 6)
    lines = wait_until(lambda: LINE.findall(output(proc)), 30, "a stats line")
    assert {engine for engine, _ in lines} == {"0", "1"}  # both engines ran requests
    assert any(float(gen) > 0 for _, gen in lines)


def test_disable_log_stats(servers) -> None:
    proc, url = servers["no_stats"]
    run_requests(url, 3)
    # Past many intervals (the log line that follows comes later still):
    httpx.get(url + "/metrics")
    wait_until(lambda: '"GET /metrics' in output(proc), 30, "the access line")
    run_requests(url, 3)
    log = output(proc)
    assert not LINE.search(log)
