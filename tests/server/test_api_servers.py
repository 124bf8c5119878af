"""Several API servers over real processes: `dpserve serve --api-server-count 2` (a
launcher, two API-server processes on one listening socket, engines, the DP
coordinator) hit over HTTP with a new connection per request: both API servers
serve, /metrics adds up over them, greedy text equals one offline engine, and a
SIGTERM or Ctrl-C, a killed API server or one that fails to start leaves no process behind."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from helpers import (
    all_gone,
    descendants,
    offline_greedy_texts,
    output,
    serve,
    serve_all,
    stopping,
)

pytestmark = pytest.mark.procs

PROMPTS = ["Hello world", "Once upon a time", "def add(x, y):", "The quick brown fox",
           "1 2 3 4"]
DP_ARGS = ("--threads-per-engine", "1", "--max-model-len", "256")
API_KEY = "k-" + "7" * 16


@pytest.fixture(scope="module")
def two_api_servers(tiny_llama):
    with serve(str(tiny_llama), "--data-parallel-size", "2", "--api-server-count", "2",
               *DP_ARGS) as (proc, url):
        yield proc, url, str(tiny_llama), descendants(proc.pid)


def _names(procs) -> set[str]:
    return {p.name().removeprefix("dpserve::") for p in procs if p.is_running()}


def _counts(text: str, metric: str, label: str) -> dict[str, float]:
    """label value -> the metric's value summed over its other labels."""
    pattern = re.compile(rf'^{re.escape(metric)}\{{(.*)\}} (\S+)$')
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = pattern.match(line)
        if m:
            key = re.search(rf'{label}="([^"]*)"', m.group(1)).group(1)
            counts[key] = counts.get(key, 0.0) + float(m.group(2))
    return counts


async def _complete_new_connections(url: str, model: str, prompts: list[str]) -> list[str]:
    """Greedy completions, 8 at a time, each on a new connection (no keep-alive)."""
    limit = asyncio.Semaphore(8)
    no_reuse = httpx.Limits(max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient, prompt: str) -> str:
        async with limit:
            resp = await client.post(url + "/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

    async with httpx.AsyncClient(timeout=60, limits=no_reuse) as client:
        return await asyncio.gather(*(one(client, p) for p in prompts))


def test_processes_are_named(two_api_servers):
    proc, _, _, children = two_api_servers
    assert _names(children) >= {"APIServer_0", "APIServer_1", "EngineCore_0", "EngineCore_1",
                                "DPCoordinator"}
    assert psutil.Process(proc.pid).name() == "dpserve::Launcher"


def test_both_serve_equal_text_and_metrics_add_up(two_api_servers):
    _, url, model, _ = two_api_servers
    expected = offline_greedy_texts(model, PROMPTS, max_tokens=8)
    prompts = PROMPTS * 8  # 40 requests
    got = asyncio.run(_complete_new_connections(url, model, prompts))
    assert got == expected * 8
    # Each scrape is answered by whichever API server accepts it: all show the totals.
    for _ in range(6):
        text = httpx.get(url + "/metrics", headers={"Connection": "close"}, timeout=5).text
        by_server = _counts(text, "dpserve:api_server_requests_finished_total", "api_server")
        assert set(by_server) == {"0", "1"} and sum(by_server.values()) == 40, by_server
        assert all(n > 0 for n in by_server.values()), f"one API server served all: {by_server}"
        assert sum(_counts(text, "dpserve:request_success_total", "finished_reason")
                   .values()) == 40
        assert sum(_counts(text, "dpserve:engine_requests_finished_total", "engine")
                   .values()) == 40
        ttft_count = _counts(text, "dpserve:time_to_first_token_seconds_count", "model_name")
        assert sum(ttft_count.values()) == 40
        assert _counts(text, "dpserve:num_requests_running", "engine") == {"0": 0, "1": 0}
        queries = _counts(text, "dpserve:prefix_cache_queries_total", "engine")
        assert set(queries) == {"0", "1"} and all(q > 0 for q in queries.values())


@pytest.fixture(scope="module")
def servers_to_signal(tiny_llama):
    """One server per signal, started at once (their start-ups overlap)."""
    with serve_all(*[[str(tiny_llama), "--data-parallel-size", "2", "--api-server-count", "2",
                      *DP_ARGS]] * 2, new_session=True) as servers:
        yield dict(zip(("SIGTERM", "Ctrl-C"), servers))


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C"])
def test_a_signal_stops_every_process(servers_to_signal, how):
    # A server of its own (stopping the shared one would break the tests after it).
    # Ctrl-C: the terminal's SIGINT to the whole foreground process group.
    with stopping(servers_to_signal[how]) as (proc, url):
        children = descendants(proc.pid)
        assert _names(children) >= {"APIServer_0", "APIServer_1", "EngineCore_0",
                                    "EngineCore_1", "DPCoordinator"}
        assert httpx.get(url + "/health", timeout=5).status_code == 200
        if how == "SIGTERM":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, output(proc)[-3000:]  # drained (nothing in flight)
        assert all_gone(children, timeout=10), [p for p in children if p.is_running()]


@pytest.fixture(scope="module")
def one_engine_servers(tiny_llama):
    """Two API servers over one engine, under policy stop and with an API key, started
    at once (their start-ups overlap); a test of its own uses (and stops) each."""
    model = str(tiny_llama)
    with serve_all([model, "--api-server-count", "2", "--threads-per-engine", "1",
                    "--engine-failure-policy", "stop"],
                   [model, "--api-server-count", "2", "--api-key", API_KEY, *DP_ARGS]) as (
            servers):
        yield dict(zip(("policy_stop", "api_key"), servers))


def test_a_killed_api_server_stops_the_server_under_policy_stop(one_engine_servers, tiny_llama):
    with stopping(one_engine_servers["policy_stop"]) as (proc, url):
        children = descendants(proc.pid)
        target = [p for p in children if p.name() == "dpserve::APIServer_1"]
        assert len(target) == 1, [p.name() for p in children]
        body = {"model": str(tiny_llama), "prompt": "Hello", "max_tokens": 1000,
                "stream": True, "ignore_eos": True}  # the tiny model's context is 1024

        async def load() -> None:
            # Streams on both API servers: every one must end (an error, or a dropped
            # connection on the killed one) soon after the kill, none may hang.
            limits = httpx.Limits(max_keepalive_connections=0)
            lines = [0] * 6
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                async def one(i: int) -> None:
                    try:
                        async with client.stream("POST", url + "/v1/completions",
                                                 json=body) as resp:
                            assert resp.status_code == 200
                            async for _ in resp.aiter_lines():
                                lines[i] += 1
                    except httpx.HTTPError:
                        pass

                tasks = [asyncio.create_task(one(i)) for i in range(6)]
                for _ in range(1200):  # until every stream is under way (60 s at most)
                    if all(lines) or any(t.done() for t in tasks):
                        break
                    await asyncio.sleep(0.05)
                assert all(lines), f"not every stream started: {lines}"
                target[0].send_signal(signal.SIGKILL)
                # Bounded well below the client's 60 s timeout: none hangs.
                await asyncio.wait_for(asyncio.gather(*tasks), 45)

        asyncio.run(load())
        assert proc.wait(15) == 1
        assert all_gone(children, timeout=10), [p for p in children if p.is_running()]


def test_an_api_server_that_fails_to_start_fails_the_launch(tiny_llama, tmp_path):
    log = tmp_path / "stderr.txt"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpserve.cli", "serve", str(tiny_llama), "--port", "0",
             "--api-server-count", "2", *DP_ARGS],
            env={**os.environ, "DPSERVE_FAULT_API_SERVER_START": "1"}, stderr=stderr,
            stdout=subprocess.DEVNULL)
    seen: dict[int, psutil.Process] = {}  # every descendant it had
    names: set[str] = set()
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        for p in descendants(proc.pid):
            seen[p.pid] = p
            try:
                names.add(p.name())
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.2)
    assert proc.wait(5) == 1
    last = log.read_text().strip().splitlines()[-1]
    assert last.startswith("dpserve: error: API server failed to start: APIServer_1: "
                           "RuntimeError: injected"), log.read_text()[-3000:]
    assert "dpserve::APIServer_1" in names, names
    assert all_gone(list(seen.values()), timeout=10)


# One API-server process's metrics (argv: its index, engine 0's running count, then
# engine 0's cumulative prefix-cache queries as it saw them); one finished request.
_RECORD = """
import sys
from types import SimpleNamespace as Fake

from dpserve.protocol import SchedulerStats
from dpserve.server.metrics.prometheus import ServerMetrics

index, running, *queries = map(int, sys.argv[1:])
metrics = ServerMetrics("tiny", api_server_index=index)
for q in queries:
    metrics.record(0, SchedulerStats(0, running, 0.5, q, q // 2, 0, 10), None)
metrics.record(0, None, Fake(num_prompt_tokens=4, num_generation_tokens=3,
                             time_to_first_tokens=[0.1], inter_token_latencies=[0.05],
                             finished=[Fake(finish_reason="stop", e2e_latency=0.2)],
                             phase_times=[[0.01, 0.02, 0.03]]))
sys.stdout.write(metrics.render().decode())
"""


def test_multiprocess_metrics_merge_api_servers(tmp_path):
    """Counters sum over API-server processes; an engine's own cumulative counters
    count once however many API servers saw them; gauges take the latest value."""

    def run(*argv: int) -> str:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
        return subprocess.run([sys.executable, "-c", _RECORD, *map(str, argv)], env=env,
                              capture_output=True, text=True, check=True, timeout=60).stdout

    run(0, 3, 10, 30)  # API server 0 saw engine 0 at 10, then 30 queries
    text = run(1, 1, 20, 40)  # API server 1 saw it in between, and last at 40; it scrapes
    assert _counts(text, "dpserve:prefix_cache_queries_total", "engine") == {"0": 40}
    assert _counts(text, "dpserve:prefix_cache_hits_total", "engine") == {"0": 20}
    assert "# TYPE dpserve:prefix_cache_queries_total counter" in text
    assert _counts(text, "dpserve:num_requests_running", "engine") == {"0": 1}  # the latest
    assert _counts(text, "dpserve:api_server_requests_finished_total", "api_server") == {
        "0": 1, "1": 1}
    assert _counts(text, "dpserve:generation_tokens_total", "model_name") == {"tiny": 6}
    assert _counts(text, "dpserve:e2e_request_latency_seconds_count", "model_name") == {
        "tiny": 2}
    assert _counts(text, "dpserve:request_decode_time_seconds_count", "model_name") == {
        "tiny": 2}
    assert "process_cpu_seconds_total" in text
    assert "cumulative" not in text  # the stand-in gauges never show


def test_api_server_count_must_be_positive():
    proc = subprocess.run([sys.executable, "-m", "dpserve.cli", "serve", "--api-server-count",
                           "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--api-server-count" in lines[0], proc.stderr


def test_api_key_is_required_by_every_api_server(one_engine_servers, tiny_llama):
    """`--api-key` applies to each API server: every connection (whichever server
    accepts it) is refused without the key and served with it. The servers share one
    listening socket and whichever waits in accept() first takes a connection, so on a
    loaded machine one can take a long run of them: rounds go on until both have served
    (at most 60)."""
    key = API_KEY
    with stopping(one_engine_servers["api_key"]) as (_, url):
        fresh = {"Connection": "close"}  # a new connection each: both servers answer
        body = {"model": str(tiny_llama), "prompt": "Hi", "max_tokens": 2}
        served, by_server = 0, {}
        while served < 60 and not (served >= 12 and all(by_server.get(s) for s in "01")):
            for bad in ({}, {"Authorization": "Bearer wrong"}):
                resp = httpx.post(url + "/v1/completions", json=body, timeout=30,
                                  headers={**fresh, **bad})
                assert resp.status_code == 401, resp.text
                assert resp.json()["error"]["type"] == "invalid_request_error", resp.text
            resp = httpx.post(url + "/v1/completions", json=body, timeout=60,
                              headers={**fresh, "Authorization": f"Bearer {key}"})
            assert resp.status_code == 200, resp.text
            served += 1
            text = httpx.get(url + "/metrics", headers=fresh, timeout=5).text
            by_server = _counts(text, "dpserve:api_server_requests_finished_total",
                                "api_server")
        # Both servers served (so both checked the key), and no refused request ran.
        assert set(by_server) == {"0", "1"} and sum(by_server.values()) == served, by_server
        assert all(n > 0 for n in by_server.values()), by_server
